"""Activation memory of one learner forward/backward, read off what autograd keeps.

Per token and decoder layer the learner keeps, for backward (widths below; "act" is the
learner's dtype, fp32 is 4 bytes):

- each RMSNorm: an fp32 copy of its input and its normalised input in act (transformers
  computes the norm in fp32);
- attention: the query, key and value handed to SDPA (KV heads repeated to the query heads:
  Orbit's micro-batches carry a padding mask, so transformers repeats them) and its output;
  MLA also its two latent norms;
- a SwiGLU MLP: gate, SiLU(gate) and up (3 x width); a routed expert the same per token slot
  (top_k slots a token) plus its output before the routing weight; the router's fp32 scores;
- the LoRA adapter: each wrapped linear keeps an fp32 copy of its input (PEFT casts the input
  to the adapter's fp32 dtype; in an fp32 learner inputs shared by several linears are kept
  once) and its rank-r A output. INT4 linears keep no input: the base gets no gradient.

With gradient checkpointing only each layer's input survives the forward (hidden x act a
layer); one layer at a time is recomputed in backward, with its gradients. The log-probs
are taken from full-vocabulary logits: at the log-softmax's backward three fp32 [tokens x
vocab] tensors are alive (its saved output, the incoming gradient, the outgoing one), 12
bytes a token and vocabulary entry, in any learner dtype.

Sharded over N GPUs (tensor/expert parallel), hidden-sized tensors are whole on every GPU
and head-, intermediate-, expert- and vocabulary-sized ones split N ways.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orbit_runtime.config.learner import LOGPROB_CHUNK_TOKENS
from orbit_runtime.plan.architecture import Architecture
from orbit_runtime.plan.parameters import Linear, decoder_layer, widest_intermediate
from orbit_runtime.plan.request import PlanRequest
from orbit_runtime.plan.weights import DTYPE_BYTES, peft_targets

LOGITS_BYTES_TRAIN = 12  # fp32 saved log-softmax output + its gradient + the input gradient
LOGITS_BYTES_SCORE = 10  # no_grad scoring: the act logits, their fp32 copy, the fp32 log-softmax (bf16 counted as 2)


@dataclass
class PerToken:
    """Elements per token, by dtype class and by whether tensor parallelism splits them."""

    act_whole: int = 0
    act_split: int = 0
    fp32_whole: int = 0
    fp32_split: int = 0
    keys: set = field(default_factory=set)

    def add(self, width: int, fp32: bool = False, split: bool = False) -> None:
        name = ("fp32" if fp32 else "act") + ("_split" if split else "_whole")
        setattr(self, name, getattr(self, name) + width)

    def bytes_on(self, gpus: int, act_bytes: int) -> float:
        n = max(gpus, 1)
        return (self.act_whole + self.act_split / n) * act_bytes + (self.fp32_whole + self.fp32_split / n) * 4


def _input_of(linear: Linear, arch: Architecture) -> tuple[str, int, bool]:
    """(identity of the tensor LINEAR reads, its width per token, split by tensor parallelism?)."""
    suffix, kind = linear.suffix, linear.kind
    slots = arch.moe.top_k if kind == "routed_expert" and arch.moe else 1
    if kind == "routed_expert":
        mid = suffix in ("down_proj", "w2")
        return ("expert_mid" if mid else "expert_in", slots * linear.in_features, True)
    if suffix in ("o_proj", "down_proj"):
        return (f"{kind}_mid" if suffix == "down_proj" else "attn_out", linear.in_features, True)
    if suffix == "q_b_proj":
        return ("q_latent", linear.in_features, False)
    if suffix == "kv_b_proj":
        return ("kv_latent", linear.in_features, False)
    return ("attn_in" if kind == "attention" else "mlp_in", linear.in_features, False)


def _norm(per: PerToken, width: int, split: bool = False) -> None:
    per.add(width, fp32=True, split=split)
    per.add(width, split=split)


def layer_saved(arch: Architecture, index: int, request: PlanRequest, full_finetune: bool = False) -> PerToken:
    """What decoder layer INDEX keeps for backward, per token (see the module docstring)."""
    per, a, h = PerToken(), arch.attention, arch.hidden
    _norm(per, h)
    _norm(per, h)
    if a.kind == "gqa":
        if a.qk_norm:
            _norm(per, a.q_width + a.kv_width, split=True)
        per.add(4 * a.q_width, split=True)  # q, k and v repeated to the query heads, the output
    else:
        _norm(per, (a.q_lora_rank or 0) + a.kv_lora_rank)
        per.add(3 * a.q_width + a.out_width, split=True)  # q, k (nope + rope per head), v, the output (sdpa)
    moe = arch.moe
    if moe is not None and index in moe.layers:
        per.add(moe.top_k * (3 * moe.expert_width + h), split=True)
        per.add(moe.experts, fp32=True)
        per.add(3 * moe.shared_width, split=True)
    else:
        per.add(3 * arch.dense_width, split=True)
    learner_fp32 = request.learner_dtype == "fp32"
    for linear in decoder_layer(arch, index):
        trained = full_finetune or peft_targets(linear, request)
        if not trained or linear.kind == "router":
            continue
        key, width, split = _input_of(linear, arch)
        if full_finetune or learner_fp32:  # the input tensor itself is kept: once, however many linears read it
            if key not in per.keys:
                per.keys.add(key)
                per.add(width, fp32=learner_fp32, split=split)
        else:
            per.add(width, fp32=True, split=split)  # PEFT's fp32 copy, one per wrapped linear
        if not full_finetune:
            slots = moe.top_k if linear.kind == "routed_expert" and moe else 1
            per.add(slots * request.rank, fp32=True, split=linear.kind == "routed_expert")
    return per


def backward_scratch(arch: Architecture) -> PerToken:
    """Gradients alive while one layer runs backward: the incoming and outgoing hidden gradients and
    those of its widest intermediate pair (gate and up, or the experts' slots)."""
    per = PerToken()
    per.add(2 * arch.hidden)
    per.add(2 * max(widest_intermediate(arch), arch.attention.q_width), split=True)
    return per


@dataclass(frozen=True)
class MicroBatch:
    rows: int  # sequences in one forward/backward (of the longest planned length)
    width: int  # tokens a sequence (prompt + completion, the longest planned)
    tokens: int  # padded tokens in one forward/backward


def micro_batch(request: PlanRequest) -> MicroBatch:
    """The largest forward/backward. Micro-batches are packed up to micro_batch_tokens padded tokens
    (learner/micro_batches.py), so sequences shorter than the longest fill the budget with more rows:
    the plan takes the budget itself (or one longest sequence, if it is longer), capped by the batch
    and by micro_batch_size sequences of the longest length."""
    width = request.sequence_tokens
    rows = request.samples if request.micro_batch_size is None else min(request.samples, request.micro_batch_size)
    tokens = rows * width
    if request.micro_batch_tokens is not None:
        tokens = min(tokens, max(width, request.micro_batch_tokens))
    return MicroBatch(max(1, min(rows, tokens // width)), width, tokens)


@dataclass(frozen=True)
class UpdateMemory:
    activations: int
    logits: int  # the chunked log-softmax the learner runs
    logits_unchunked: int  # what a full [tokens x vocab] log-softmax would hold instead
    activations_without_checkpointing: int
    activations_with_checkpointing: int


def update_memory(arch: Architecture, request: PlanRequest, gpus: int = 1, full_finetune: bool = False) -> UpdateMemory:
    """Activations and logits of the learner's largest micro-batch, on one of GPUS shards."""
    mb = micro_batch(request)
    act_bytes = DTYPE_BYTES[request.learner_dtype]
    n = max(gpus, 1)
    per_layer = [layer_saved(arch, i, request, full_finetune).bytes_on(n, act_bytes) for i in range(arch.layers)]
    scratch = backward_scratch(arch).bytes_on(n, act_bytes)
    final_norm = arch.hidden * (4 + act_bytes)
    mask = mb.tokens * mb.width  # transformers' boolean [rows, 1, S, S] padding mask, shared by the layers
    recompute = max(per_layer) + scratch
    with_gc = mb.tokens * (arch.layers * arch.hidden * act_bytes + recompute + final_norm) + mask
    without_gc = mb.tokens * (sum(per_layer) + scratch + final_norm) + mask
    vocab = arch.vocab / n
    logit_tokens = mb.tokens - mb.rows  # every position but each sequence's last
    return UpdateMemory(
        activations=int(with_gc if request.gradient_checkpointing else without_gc),
        logits=int(LOGITS_BYTES_TRAIN * min(logit_tokens, LOGPROB_CHUNK_TOKENS) * vocab),
        logits_unchunked=int(LOGITS_BYTES_TRAIN * logit_tokens * vocab),
        activations_without_checkpointing=int(without_gc),
        activations_with_checkpointing=int(with_gc),
    )


def scoring_memory(arch: Architecture, request: PlanRequest, gpus: int = 1) -> tuple[int, int]:
    """(activations, logits) of a no-grad scoring pass (the reference server) over the largest micro-batch:
    one layer's tensors at a time and the logits' log-softmax."""
    mb = micro_batch(request)
    act_bytes = DTYPE_BYTES[request.learner_dtype]
    layer = max(layer_saved(arch, i, request).bytes_on(gpus, act_bytes) for i in range(arch.layers))
    logit_tokens = min(mb.tokens - mb.rows, LOGPROB_CHUNK_TOKENS)
    return int(mb.tokens * layer), int(LOGITS_BYTES_SCORE * logit_tokens * arch.vocab / max(gpus, 1))
