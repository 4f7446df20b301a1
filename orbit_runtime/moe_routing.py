"""Mixture-of-experts routing: which experts a token goes to and with what weights.

Pure tensor math shared by the learner (`learner/moe.py`) and the rollout's CPU MoE model
(`rollout/vllm_cpu_moe.py`), so both choose experts with one implementation. Qwen3-MoE
scores with a softmax in fp32 over router logits in the model dtype, then top-k, optionally
renormalised; DeepSeek-V3 scores with a sigmoid, picks experts group-limited with the
`e_score_correction_bias`, weights them by their uncorrected scores, renormalises and scales
by `routed_scaling_factor` (as transformers and vLLM's `grouped_topk` do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from orbit_runtime.errors import OrbitError

# model_type -> the transformers class name of its sparse MoE block
MOE_BLOCK_CLASSES = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE"}


@dataclass(frozen=True)
class RoutingSpec:
    """How a token's experts and their weights are chosen (read from the model config)."""

    num_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid"]
    renormalize: bool
    num_groups: int = 1
    topk_groups: int = 1
    scaling_factor: float = 1.0
    correction_bias: bool = False

    @classmethod
    def from_config(cls, config) -> RoutingSpec:
        model_type = config.model_type
        if model_type == "qwen3_moe":
            return cls(config.num_experts, config.num_experts_per_tok, "softmax", bool(config.norm_topk_prob))
        if model_type == "deepseek_v3":
            # vLLM reads these two (defaults: softmax, no bias); DeepSeek-V3's checkpoints set them so
            if getattr(config, "moe_layer_freq", 1) != 1:  # vLLM honours it, transformers' model does not
                raise OrbitError(f"deepseek_v3 moe_layer_freq={config.moe_layer_freq}: only 1 (every layer after "
                                 "first_k_dense_replace is MoE) is supported")  # fmt: skip
            scoring, method = getattr(config, "scoring_func", "sigmoid"), getattr(config, "topk_method", "noaux_tc")
            if (scoring, method) != ("sigmoid", "noaux_tc"):
                raise OrbitError(
                    f"deepseek_v3 routing scoring_func={scoring!r}, topk_method={method!r}: only DeepSeek-V3's "
                    "sigmoid + noaux_tc routing is supported"
                )
            return cls(
                config.n_routed_experts,
                config.num_experts_per_tok,
                "sigmoid",
                bool(config.norm_topk_prob),
                num_groups=config.n_group,
                topk_groups=config.topk_group,
                scaling_factor=float(config.routed_scaling_factor),
                correction_bias=True,
            )
        raise OrbitError(f"MoE model_type {model_type!r} is not supported; supported: {sorted(MOE_BLOCK_CLASSES)}")


def select_experts(router_logits: torch.Tensor, spec: RoutingSpec, correction_bias: torch.Tensor | None = None):
    """Router logits [N, E] -> (weights [N, k] float32, expert ids [N, k]). Pure: the rollout uses it too."""
    ids = choose_experts(router_logits, spec, correction_bias)
    return gate_weights(router_logits, ids, spec), ids


def choose_experts(router_logits: torch.Tensor, spec: RoutingSpec, correction_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Which K experts each token goes to: router logits [N, E] -> expert ids [N, k] (no gradient)."""
    if spec.scoring == "softmax":
        return torch.topk(torch.softmax(router_logits.float(), dim=-1), spec.top_k, dim=-1).indices
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    if spec.num_groups > 1:
        per_group = choice.view(-1, spec.num_groups, spec.num_experts // spec.num_groups)
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # DeepSeek-V3: sum of each group's top 2
        groups = torch.topk(group_scores, spec.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(spec.num_experts // spec.num_groups, dim=1), float("-inf"))
    return torch.topk(choice, spec.top_k, dim=-1, sorted=False).indices


def gate_weights(router_logits: torch.Tensor, ids: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """The weights of experts IDS [N, k] from router logits [N, E]: float32 [N, k], differentiable in the logits.

    Separate from the choice so routing replay can weight the rollout's experts by the learner's
    own scores (R3): softmax scores renormalised over the chosen k (Qwen3-MoE with norm_topk_prob),
    or sigmoid scores renormalised and scaled (DeepSeek-V3).
    """
    if spec.scoring == "softmax":
        weights = torch.softmax(router_logits.float(), dim=-1).gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True) if spec.renormalize else weights
    weights = router_logits.float().sigmoid().gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.scaling_factor
