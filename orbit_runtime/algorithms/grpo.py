"""GRPO: group-normalised advantages and a clipped policy-gradient loss with options from
DAPO (clip-higher, token-level mean), Dr.GRPO (no std normalisation, fixed-length sum), a
k3 KL penalty to the reference policy, and truncated / masked importance sampling (TIS /
MIS) that corrects for the rollout engine's log-probs differing from the learner's.

Shapes: B sequences, T completion positions (right-padded; `mask` is 1 on real tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossAggregation = Literal["token_mean", "sequence_mean", "token_sum_norm"]
MismatchCorrection = Literal["none", "tis", "mis"]


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """[B] rewards, consecutive groups of GROUP_SIZE -> [B] advantages (reward - group mean) [/ group std].

    A group whose rewards are all equal gets zero advantage (no signal, no NaN).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred.view(-1)


def k3_kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1, d = ref - policy.

    Written as expm1(d) - d: for the small d of a policy near its reference, exp(d) - 1
    cancels to 0 in fp32.
    """
    delta = ref_logprobs - logprobs
    return torch.expm1(delta) - delta


def mismatch_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mode: MismatchCorrection, cap: float
) -> torch.Tensor:
    """Per-token importance weights for learner-vs-rollout mismatch (no gradient).

    tis: min(p_learner / p_rollout, cap). mis: 1 where the ratio is within [1/cap, cap], else 0.
    """
    ratio = torch.exp(old_logprobs.detach() - rollout_logprobs.detach())
    if mode == "none":
        return torch.ones_like(ratio)
    if mode == "tis":
        return ratio.clamp(max=cap)
    if mode == "mis":
        return ((ratio <= cap) & (ratio >= 1.0 / cap)).to(ratio.dtype)
    raise ValueError(f"unknown mismatch correction {mode!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: LossAggregation, max_tokens: int) -> torch.Tensor:
    """Reduce [B, T] per-token losses to a scalar (see module docstring for the modes)."""
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if mode == "sequence_mean":
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if mode == "token_sum_norm":
        return (per_token * mask).sum() / (per_token.shape[0] * max_tokens)
    raise ValueError(f"unknown loss aggregation {mode!r}")


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_beta: float = 0.0
    aggregation: LossAggregation = "token_mean"
    correction: MismatchCorrection = "tis"
    is_cap: float = 2.0
    max_tokens: int = 1  # for token_sum_norm


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # [B, T] learner, with grad
    old_logprobs: torch.Tensor  # [B, T] learner before this update
    rollout_logprobs: torch.Tensor  # [B, T] rollout engine's, for the sampled tokens
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T]
    ref_logprobs: torch.Tensor | None = None  # [B, T], needed when kl_beta > 0


@dataclass
class LossOutputs:
    loss: torch.Tensor
    policy_loss: float
    kl: float
    clip_fraction: float  # share of tokens whose ratio was clipped
    is_weight_mean: float  # mean mismatch weight (tis) or kept share (mis)


def grpo_loss(inputs: LossInputs, config: LossConfig) -> LossOutputs:
    """Clipped surrogate with per-token mismatch weights, plus beta * k3 KL, aggregated."""
    mask = inputs.mask.to(inputs.logprobs.dtype)
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs.detach())
    advantages = inputs.advantages.to(inputs.logprobs.dtype).unsqueeze(1)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * advantages
    weights = mismatch_weights(inputs.old_logprobs, inputs.rollout_logprobs, config.correction, config.is_cap)
    per_token = -torch.minimum(unclipped, clipped) * weights
    policy = aggregate(per_token, mask, config.aggregation, config.max_tokens)
    loss = policy
    kl_value = 0.0
    if config.kl_beta > 0:
        if inputs.ref_logprobs is None:
            raise ValueError("kl_beta > 0 needs reference log-probs")
        kl = aggregate(k3_kl_penalty(inputs.logprobs, inputs.ref_logprobs), mask, config.aggregation, config.max_tokens)
        loss = loss + config.kl_beta * kl
        kl_value = float(kl.detach())
    elif inputs.ref_logprobs is not None:
        kl_value = float(aggregate(k3_kl_penalty(inputs.logprobs.detach(), inputs.ref_logprobs), mask, "token_mean", 1))
    tokens = mask.sum().clamp(min=1)
    clip_fraction = float((((unclipped - clipped).abs() > 0).to(mask.dtype) * mask).sum() / tokens)
    return LossOutputs(
        loss=loss,
        policy_loss=float(policy.detach()),
        kl=kl_value,
        clip_fraction=clip_fraction,
        is_weight_mean=float((weights * mask).sum() / tokens),
    )
