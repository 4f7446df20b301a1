"""DeepSeek-V3 for vLLM's CPU build: vLLM's own MLA attention, routed experts as INT4 linears.

Stock vLLM cannot load an INT4 DeepSeek-V3 on CPU: its CPU W4A16 fused-MoE kernel does not
support grouped top-k routing ("No WNA16 MoE backend supports the deployment configuration";
docs/moe.md). It has the rest: MLA attention (the `CPU_SDPA_MLA` prefill and a decode
backend) and the W4A16 linear kernel. So this model, registered for CPU only by
`orbit_runtime.rollout.vllm_plugin`, takes vLLM's `DeepseekV2MLAAttention` and dense MLPs as
they are and swaps the fused MoE for `ExpertLinearsMoeBlock` (`vllm_cpu_moe.py`): each routed
and shared expert an INT4 linear, routed by Orbit's `select_experts` (DeepSeek-V3's sigmoid,
group-limited choice with the correction bias, fp32 router logits as the learner computes them).

One fix to vLLM's CPU build: its `rotary_embedding` op rotates a 3-D query [tokens, heads,
dims] wrongly when there is more than one head (the 2-D [tokens, heads * dims] layout is
right), and MLA passes the 3-D one. `FlatRotary` hands the op the 2-D layout.

Two differences from vLLM's GPU model, both to compute what the learner computes:
- no fp16 rescaling of the hidden states by `1/routed_scaling_factor` (vLLM's overflow guard;
  the learner, like transformers, does not rescale);
- LoRA on `kv_b_proj` is not served: MLA's prefill calls the projection through its attention
  implementation's own reference, taken before vLLM wraps it for LoRA, and its decode uses the
  absorbed weights (`W_UK`, `W_UV`). The trainer refuses such an adapter
  (`config.adapter.UNSERVED_LORA_TARGETS`).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention, DeepseekV2MLP
from vllm.model_executor.models.utils import WeightsMapper, extract_layer_index

from orbit_runtime.rollout.vllm_cpu_moe import ExpertLinearsDecoderLayer, ExpertLinearsForCausalLM


class FlatRotary(nn.Module):
    """vLLM's rotary embedding, called with queries and keys flattened to [tokens, heads * dims].

    vLLM's CPU `rotary_embedding` op gets a [tokens, heads, dims] query with heads > 1 wrong
    (off by O(1) against its own `forward_native`; `test_moe_vllm_parity.py` shows it)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        tokens = query.shape[0]
        flat_query, flat_key = self.rotary(positions, query.reshape(tokens, -1).contiguous(), key.reshape(tokens, -1).contiguous())
        return flat_query.view(query.shape), flat_key.view(key.shape)


def flat_if_it_calls_the_op(rotary: nn.Module) -> nn.Module:
    """ROTARY wrapped in FlatRotary when its CPU forward is the `rotary_embedding` op (default
    rope); as it is otherwise: DeepSeek's YaRN rope computes in PyTorch on CPU, on the 3-D layout."""
    return FlatRotary(rotary) if type(rotary).forward_cpu is RotaryEmbedding.forward_cpu else rotary


class DeepseekDecoderLayer(ExpertLinearsDecoderLayer):
    """vLLM's DeepSeek attention (MLA) and dense MLP, Orbit's expert-linear MoE block."""

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        if not vllm_config.model_config.use_mla:  # (VLLM_MLA_DISABLE) its attention calls kv_b_proj and rope otherwise
            raise ValueError("Orbit's CPU DeepSeek-V3 model runs with MLA attention only; unset VLLM_MLA_DISABLE")
        self.self_attn = DeepseekV2MLAAttention(
            vllm_config=vllm_config,
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            q_lora_rank=getattr(config, "q_lora_rank", None),
            kv_lora_rank=config.kv_lora_rank,
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.self_attn",
        )
        self.self_attn.mla_attn.rotary_emb = flat_if_it_calls_the_op(self.self_attn.mla_attn.rotary_emb)
        layer_index = extract_layer_index(prefix)
        sparse = layer_index >= config.first_k_dense_replace and layer_index % getattr(config, "moe_layer_freq", 1) == 0
        self._mlp_and_norms(vllm_config, prefix, sparse, DeepseekV2MLP)

    def attend(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions, hidden_states, None)


class CpuInt4DeepseekV3ForCausalLM(ExpertLinearsForCausalLM):
    """`DeepseekV3ForCausalLM` for vLLM on CPU, with INT4 experts as linears (see the module docstring)."""

    decoder_layer = DeepseekDecoderLayer
    # checkpoint (and adapter) names -> this model's: routed experts live in `expert_linears`;
    # gate/up are fused as vLLM fuses them, and so are MLA's q_a and kv_a projections
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_substr={".experts.": ".expert_linears."},
        orig_to_new_stacked={
            ".q_a_proj": (".fused_qkv_a_proj", 0),
            ".kv_a_proj_with_mqa": (".fused_qkv_a_proj", 1),
            ".gate_proj": (".gate_up_proj", 0),
            ".up_proj": (".gate_up_proj", 1),
        },
    )
    packed_modules_mapping = {
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        if getattr(vllm_config.model_config.hf_text_config, "q_lora_rank", None) is None:
            # vLLM then names the kv projection `kv_a_proj_with_mqa` unfused; not mapped here
            raise ValueError("Orbit's CPU DeepSeek-V3 model needs q_lora_rank (low-rank q, as DeepSeek-V3 has)")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
