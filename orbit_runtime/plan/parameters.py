"""Every weight of a model, by module, from its Architecture: parameter counts (total and
active per token) and the list of linear layers that quantization, LoRA and sharding act on.

Each linear is named as its checkpoint names it (`model.layers.3.mlp.experts.0.gate_proj`),
so `orbit quantize`'s ignore patterns and PEFT's target names apply to it exactly as they
do to the real model. Routed experts of one layer are one entry with `count` experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from orbit_runtime.plan.architecture import Architecture

Kind = Literal["attention", "dense_mlp", "shared_expert", "routed_expert", "router", "lm_head"]
# How tensor/expert parallelism splits a linear over N GPUs (as vLLM shards it):
# split: 1/N each (column or row parallel, experts over ranks); kv: 1/min(N, kv_heads) (KV heads
# are replicated when there are more ranks than heads); replicated: whole on every GPU.
Shard = Literal["split", "kv", "replicated"]


@dataclass(frozen=True)
class Linear:
    name: str  # module path (for routed experts: expert 0's)
    in_features: int
    out_features: int
    kind: Kind
    shard: Shard = "split"
    count: int = 1  # identical modules (the routed experts of one layer)
    bias: bool = False

    @property
    def suffix(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def params(self) -> int:
        return self.count * (self.in_features * self.out_features + (self.out_features if self.bias else 0))


def _mlp(prefix: str, hidden: int, width: int, kind: Kind, names=("gate_proj", "up_proj", "down_proj"), count: int = 1,
         bias: bool = False) -> list[Linear]:  # fmt: skip
    gate, up, down = names
    return [Linear(f"{prefix}.{gate}", hidden, width, kind, count=count, bias=bias),
            Linear(f"{prefix}.{up}", hidden, width, kind, count=count, bias=bias),
            Linear(f"{prefix}.{down}", width, hidden, kind, count=count, bias=bias)]  # fmt: skip


def _attention(arch: Architecture, prefix: str) -> list[Linear]:
    a, h = arch.attention, arch.hidden
    if a.kind == "gqa":
        return [
            Linear(f"{prefix}.q_proj", h, a.q_width, "attention", bias=a.qkv_bias),
            Linear(f"{prefix}.k_proj", h, a.kv_width, "attention", shard="kv", bias=a.qkv_bias),
            Linear(f"{prefix}.v_proj", h, a.kv_width, "attention", shard="kv", bias=a.qkv_bias),
            Linear(f"{prefix}.o_proj", a.out_width, h, "attention", bias=a.o_bias),
        ]
    # MLA: the down-projections (to the q and kv latents) are replicated on every rank in vLLM
    q = ([Linear(f"{prefix}.q_a_proj", h, a.q_lora_rank, "attention", shard="replicated"),
          Linear(f"{prefix}.q_b_proj", a.q_lora_rank, a.q_width, "attention")]
         if a.q_lora_rank else [Linear(f"{prefix}.q_proj", h, a.q_width, "attention")])  # fmt: skip
    return [
        *q,
        Linear(f"{prefix}.kv_a_proj_with_mqa", h, a.kv_lora_rank + a.qk_rope_head_dim, "attention", shard="replicated"),
        Linear(f"{prefix}.kv_b_proj", a.kv_lora_rank, a.heads * (a.qk_nope_head_dim + a.v_head_dim), "attention"),
        Linear(f"{prefix}.o_proj", a.out_width, h, "attention", bias=a.o_bias),
    ]


def _layer_mlp(arch: Architecture, index: int, prefix: str) -> list[Linear]:
    moe, h = arch.moe, arch.hidden
    if moe is None or index not in moe.layers:
        return _mlp(f"{prefix}.mlp", h, arch.dense_width, "dense_mlp", bias=arch.mlp_bias)
    if moe.naming == "mixtral":
        block = f"{prefix}.block_sparse_moe"
        return [Linear(f"{block}.gate", h, moe.experts, "router", shard="replicated"),
                *_mlp(f"{block}.experts.0", h, moe.expert_width, "routed_expert", ("w1", "w3", "w2"), count=moe.experts)]  # fmt: skip
    block = f"{prefix}.mlp"
    out = [Linear(f"{block}.gate", h, moe.experts, "router", shard="replicated"),
           *_mlp(f"{block}.experts.0", h, moe.expert_width, "routed_expert", count=moe.experts)]  # fmt: skip
    if moe.shared_width:
        shared = "shared_experts" if moe.naming == "deepseek" else "shared_expert"
        out += _mlp(f"{block}.{shared}", h, moe.shared_width, "shared_expert")
    if moe.shared_gate:
        out.append(Linear(f"{block}.shared_expert_gate", h, 1, "router", shard="replicated"))
    return out


def decoder_layer(arch: Architecture, index: int) -> list[Linear]:
    """The linears of decoder layer INDEX."""
    prefix = f"model.layers.{index}"
    return [*_attention(arch, f"{prefix}.self_attn"), *_layer_mlp(arch, index, prefix)]


def model_linears(arch: Architecture) -> list[Linear]:
    """Every linear the model computes with (MTP layers excluded), LM head included unless tied."""
    out = [linear for index in range(arch.layers) for linear in decoder_layer(arch, index)]
    if not arch.tie_embeddings:
        out.append(Linear("lm_head", arch.hidden, arch.vocab, "lm_head"))
    return out


def widest_intermediate(arch: Architecture) -> int:
    """The widest MLP intermediate a token goes through in one layer: the dense MLP, its top_k routed
    experts' slots together, or the shared expert (scratch and gradient sizes are in its multiples)."""
    moe = arch.moe
    return max(arch.dense_width, moe.top_k * moe.expert_width if moe else 0, moe.shared_width if moe else 0)


def layer_norm_params(arch: Architecture) -> int:
    """RMSNorm weights of one decoder layer (input, post-attention, and the attention's own)."""
    a = arch.attention
    own = (a.q_lora_rank or 0) + a.kv_lora_rank if a.kind == "mla" else (2 * a.head_dim if a.qk_norm else 0)
    return 2 * arch.hidden + own


@dataclass(frozen=True)
class ParameterCount:
    """Parameters by group; `total` and `active` are the whole model without its MTP layers."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    attention: int
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    routers: int  # router weights and biases (DeepSeek's correction bias)
    norms: int
    routed_experts_active: int  # the routed experts one token uses (top_k of each MoE layer's experts)
    mtp: int  # unique parameters of the MTP layers (their stored copies of embedding and head not counted)

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.dense_mlp + self.routed_experts + self.shared_experts
                + self.routers + self.norms)  # fmt: skip

    @property
    def active(self) -> int:
        """Per token, counting the embedding matrix (as Qwen's and Mistral's model cards do)."""
        return self.total - self.routed_experts + self.routed_experts_active

    @property
    def active_without_input_embedding(self) -> int:
        """Per token without the input embedding, whose one row a token reads (DeepSeek's own convention)."""
        return self.active - self.embedding

    def groups(self) -> dict[str, int]:
        return {"embedding": self.embedding, "lm_head": self.lm_head, "attention": self.attention, "dense_mlp": self.dense_mlp,
                "routed_experts": self.routed_experts, "shared_experts": self.shared_experts, "routers": self.routers,
                "norms": self.norms}  # fmt: skip


def _mtp_params(arch: Architecture) -> int:
    """The MTP modules: each a decoder layer shaped like the last one (MoE in DeepSeek-V3) plus
    enorm, hnorm, the eh_proj (2h -> h) and the shared head's norm."""
    if not arch.mtp_layers:
        return 0
    last = arch.layers - 1
    layer = sum(linear.params for linear in decoder_layer(arch, last)) + layer_norm_params(arch)
    if arch.moe is not None and arch.moe.correction_bias and last in arch.moe.layers:
        layer += arch.moe.experts
    return arch.mtp_layers * (layer + 3 * arch.hidden + 2 * arch.hidden * arch.hidden)


def count_parameters(arch: Architecture) -> ParameterCount:
    groups = {"attention": 0, "dense_mlp": 0, "routed_expert": 0, "shared_expert": 0, "router": 0, "lm_head": 0}
    routed_active = 0
    for linear in model_linears(arch):
        groups[linear.kind] += linear.params
        if linear.kind == "routed_expert":
            routed_active += linear.params * arch.moe.top_k // linear.count  # type: ignore[union-attr]
    moe_layers = len(arch.moe.layers) if arch.moe else 0
    correction = arch.moe.experts * moe_layers if arch.moe is not None and arch.moe.correction_bias else 0
    return ParameterCount(
        embedding=arch.vocab * arch.hidden,
        lm_head=groups["lm_head"],
        attention=groups["attention"],
        dense_mlp=groups["dense_mlp"],
        routed_experts=groups["routed_expert"],
        shared_experts=groups["shared_expert"],
        routers=groups["router"] + correction,
        norms=arch.layers * layer_norm_params(arch) + arch.hidden,  # + the final norm
        routed_experts_active=routed_active,
        mtp=_mtp_params(arch),
    )
