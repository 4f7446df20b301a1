"""Qwen3-MoE for vLLM's CPU build: every routed expert is a plain INT4 linear layer.

(`ExpertLinearsMoeBlock` also serves the DeepSeek-V3 model in `vllm_cpu_deepseek.py`.)

vLLM's CPU build cannot run this model as stock vLLM builds it (PLATFORM.md): its fused
INT4 MoE kernel needs AMX, and with LoRA enabled every `FusedMoE` layer takes a Triton
MoE-LoRA backend that does not run on CPU. This implementation, registered for CPU only by
`orbit_runtime.rollout.vllm_plugin`, builds the same model from vLLM's own layers, except
that each routed expert is a `Qwen3MoeMLP` (a `MergedColumnParallelLinear` gate/up and a
`RowParallelLinear` down projection). Those take vLLM's CPU W4A16 linear kernel, and vLLM's
LoRA manager wraps them like any linear, so routed-expert LoRA in the per-expert PEFT
layout (`experts.<e>.gate_proj`) loads too.

What differs from the stock GPU model: the experts are computed for every token and
weighted by the routing (zero for experts a token did not choose) rather than dispatched,
because vLLM's LoRA kernels map LoRA to tokens by position in the whole batch and cannot
see a gathered subset. The routing is Orbit's `select_experts`, the learner's own
(softmax in fp32, top-k, renormalised, as vLLM's `FusedMoE` does). So the CPU path proves
the INT4 weights, the routing decisions, LoRA on attention and experts, adapter sync and
the RL loop; it does not prove vLLM's fused GPU MoE kernels (the GPU check script does the
learner side there).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsLoRA
from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeMLP
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, extract_layer_index, make_layers, maybe_prefix
from vllm.sequence import IntermediateTensors

from orbit_runtime.moe_routing import RoutingSpec, select_experts


class ExpertLinearsMoeBlock(nn.Module):
    """Router (16 bit, unquantized as in the checkpoint) + routed experts as INT4 linears, and
    the shared experts of DeepSeek-V3-style models (`n_shared_experts`), added unweighted."""

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.spec = RoutingSpec.from_config(config)
        # vLLM's RoutedExpertsCaptureSource: its capturer (or Orbit's, routing_capture.py) sets capture_fn
        self.layer_id = extract_layer_index(prefix)
        self.capture_fn = None
        self.gate = ReplicatedLinear(
            config.hidden_size, self.spec.num_experts, bias=False, quant_config=None, prefix=f"{prefix}.gate"
        )
        if self.spec.correction_bias:  # DeepSeek-V3's selection bias, fp32 as in the checkpoint
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.empty(self.spec.num_experts, dtype=torch.float32), requires_grad=False
            )
        shared = config.moe_intermediate_size * (getattr(config, "n_shared_experts", None) or 0)
        self.shared_experts = (
            Qwen3MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=shared,
                hidden_act=config.hidden_act,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.shared_experts",
            )
            if shared
            else None
        )
        # Not named `experts`: vLLM's LoRA loader takes any `.experts` module for a FusedMoE
        # one. The weights mapper renames the checkpoint's and the adapter's `.experts.`.
        self.expert_linears = nn.ModuleList(
            Qwen3MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.expert_linears.{index}",
            )
            for index in range(self.spec.num_experts)
        )

    def router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """As the learner's `Router.logits`: in the model dtype, or fp32 for DeepSeek-V3 (as transformers)."""
        if self.spec.scoring == "sigmoid":
            return torch.nn.functional.linear(hidden_states.float(), self.gate.weight.float())
        return self.gate(hidden_states)[0]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.router_logits(hidden_states)
        weights, ids = select_experts(router_logits, self.spec, getattr(self.gate, "e_score_correction_bias", None))
        if self.capture_fn is not None:
            self.capture_fn(ids)
        # [tokens, experts]: the routing weight of each expert, zero where not chosen
        per_expert = torch.zeros_like(router_logits, dtype=torch.float32).scatter_(1, ids, weights)
        per_expert = per_expert.to(hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        for index, expert in enumerate(self.expert_linears):  # in expert order, as the learner adds them
            weight = per_expert[:, index : index + 1]
            # an expert a token did not choose adds exactly 0, even if its fp16 output overflowed
            out += (expert(hidden_states) * weight).masked_fill(weight == 0, 0)
        if self.shared_experts is not None:  # after the routed ones, as the learner adds them
            out = out + self.shared_experts(hidden_states)
        return out


class ExpertLinearsDecoderLayer(nn.Module):
    """Attention (the subclass's), then the MoE block or a dense MLP, with vLLM's fused residual norms."""

    def _mlp_and_norms(self, vllm_config: VllmConfig, prefix: str, sparse: bool, dense_mlp: type[nn.Module]) -> None:
        config = vllm_config.model_config.hf_text_config
        if sparse:
            self.mlp = ExpertLinearsMoeBlock(vllm_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = dense_mlp(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attend(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.attend(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderLayer(ExpertLinearsDecoderLayer):
    """vLLM's Qwen3-MoE attention and norms around `ExpertLinearsMoeBlock`."""

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.self_attn = Qwen3MoeAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            rope_parameters=config.rope_parameters,
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=getattr(config, "attention_bias", False),
            head_dim=getattr(config, "head_dim", None),
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.self_attn",
        )
        layer_index = extract_layer_index(prefix)
        sparse = layer_index not in (getattr(config, "mlp_only_layers", None) or []) and (
            (layer_index + 1) % config.decoder_sparse_step == 0
        )
        self._mlp_and_norms(vllm_config, prefix, sparse, Qwen3MoeMLP)

    def attend(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions=positions, hidden_states=hidden_states)


class ExpertLinearsModel(nn.Module):
    """Embedding, DECODER_LAYER × num_hidden_layers, final norm: vLLM's model body, any decoder layer."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str, decoder_layer: type[nn.Module]) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: decoder_layer(vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class ExpertLinearsForCausalLM(nn.Module, SupportsLoRA):
    """A causal LM of `ExpertLinearsModel` + vLLM's head and logits; subclasses name the decoder
    layer and how checkpoint names map onto it."""

    decoder_layer: type[nn.Module]
    hf_to_vllm_mapper: WeightsMapper
    # No LoRA on the embedding or the head (as vLLM's Qwen2): Orbit adapts linears only, and vLLM's
    # LoRA head on its CPU build crashes on prompt log-probs of several sequences in one batch
    # (bgmv over per-sequence indices against per-token logits), which the trainer's canary asks for
    embedding_modules: dict[str, str] = {}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = ExpertLinearsModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                        decoder_layer=self.decoder_layer)  # fmt: skip
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=self.quant_config, prefix=maybe_prefix(prefix, "lm_head")
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = ["lm_head."] if self.config.tie_word_embeddings else None  # the embedding is the head
        loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=tied)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)


class CpuInt4Qwen3MoeForCausalLM(ExpertLinearsForCausalLM):
    """`Qwen3MoeForCausalLM` for vLLM on CPU, with INT4 experts as linears (see the module docstring)."""

    decoder_layer = DecoderLayer
    # checkpoint (and adapter) names -> this model's: routed experts live in `expert_linears`,
    # gate/up and q/k/v projections are fused as vLLM fuses them (routed experts included)
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_substr={".experts.": ".expert_linears."},
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0),
            ".up_proj": (".gate_up_proj", 1),
        }
    )
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
