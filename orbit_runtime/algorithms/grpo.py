"""GRPO: group-normalised advantages and a clipped policy-gradient loss with options from
DAPO (clip-higher, token-level mean), Dr.GRPO (no std normalisation, fixed-length sum),
dual-clip PPO, a k3 KL penalty to the reference policy, and truncated / masked importance
sampling (TIS / MIS) that corrects for the rollout engine's log-probs differing from the
learner's.

Shapes: B sequences, T completion positions (right-padded; `mask` is nonzero on real tokens).

Padding is never trusted: every [B, T] input is replaced by 0 at masked positions before any
arithmetic (`torch.where`, not `x * mask`, since NaN * 0 = NaN), so whatever a padded slot
holds - NaN, inf, garbage - changes neither the loss, nor its gradient, nor the statistics.

Aggregation (`aggregate`; the same reduction is used for the KL term). A sequence is
*non-empty* if it has at least one real token; empty sequences are left out of every
denominator, as verl's `agg_loss` does:

- token_mean (DAPO; verl "token-mean"): sum over real tokens / number of real tokens.
- sequence_mean (GRPO; verl "seq-mean-token-mean"): mean over each sequence's real tokens,
  then mean over the non-empty sequences.
- token_sum_norm (Dr.GRPO; verl "seq-mean-token-sum-norm"): sum over real tokens /
  (non-empty sequences * max_tokens). `max_tokens` must be given (the rollout's generation
  limit): it is a constant, so a sequence's weight does not depend on its length.

Micro-batches: a loss over part of a batch takes the whole batch's denominators
(`BatchTotals`: real tokens and non-empty sequences), so the parts' losses - and their
gradients and statistics - add up to exactly the whole batch's.

Mismatch correction (`mismatch_weights`), with rho = p_learner_old / p_rollout of the sampled
token (no gradient), per token or - `mismatch_level="sequence"` - one rho per sequence, the
product of its tokens' ratios (exp of the summed log-ratios over its real tokens, verl's
"sequence" level; not the geometric mean):

- tis: weight min(rho, C).
- mis: weight rho if rho <= C, else 0 (the token, or the whole sequence, is rejected).

Rejected tokens stay in the aggregation denominators (they contribute 0 to the sum): the
weight is a per-token coefficient like TIS's, the loss stays a Monte-Carlo average over the
sampled tokens, and its scale does not jump when the mismatch rejects many tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

LossAggregation = Literal["token_mean", "sequence_mean", "token_sum_norm"]
MismatchCorrection = Literal["none", "tis", "mis"]
MismatchLevel = Literal["token", "sequence"]

LOG_RATIO_BOUND = 20.0  # k3 KL: the log-ratio is bounded to +-20 before exp (as verl low_var_kl) so exp never overflows


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """[B] rewards, consecutive groups of GROUP_SIZE -> [B] float32 advantages (reward - group mean) [/ group std].

    A group whose rewards are all equal gets exactly zero advantage: it carries no signal, and
    the float rounding of its mean (e.g. eight float32 0.7s do not average to 0.7) divided by a
    std near 0 would otherwise turn into spurious advantages of several percent.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, 0.0, centred).float().view(-1)


def k3_kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1, d = ref - policy.

    Written as expm1(d) - d: for the small d of a policy near its reference, exp(d) - 1
    cancels to 0 in fp32. d is bounded to +-LOG_RATIO_BOUND first so exp stays finite (and the
    gradient of a clamped value is 0, not 0 * inf = NaN). CLAMP, if given, bounds the estimate
    to [-clamp, clamp] (k3 >= 0, so in effect an upper bound; verl's low_var_kl uses 10): a few
    tokens the reference finds far likelier than the policy cannot dominate the loss.
    """
    delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    kl = torch.expm1(delta) - delta
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def _log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, level: MismatchLevel, real: torch.Tensor) -> torch.Tensor:
    """log rho per token: learner (before the update) minus rollout, or at LEVEL sequence each sequence's sum on all its tokens."""
    log_ratio = torch.where(real, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)
    if level == "sequence":
        return log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    if level != "token":
        raise ValueError(f"unknown mismatch level {level!r}")
    return log_ratio


def _mismatch(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mode: MismatchCorrection,
    cap: float,
    level: MismatchLevel,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, rejected, log rho): see `mismatch_weights`; REJECTED is True where MIS zeroed a weight."""
    real = torch.ones_like(old_logprobs, dtype=torch.bool) if mask is None else mask.bool()
    log_ratio = _log_ratio(old_logprobs, rollout_logprobs, level, real)
    return (*_correction(log_ratio, mode, cap, real), log_ratio)


def _correction(log_ratio: torch.Tensor, mode: MismatchCorrection, cap: float, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, rejected) for the per-token LOG_RATIO under MODE."""
    no_rejection = torch.zeros_like(real)
    if mode == "none":
        return torch.ones_like(log_ratio), no_rejection
    rho = torch.exp(log_ratio)  # may be inf for a huge log-ratio: min(inf, C) = C, and inf > C is rejected
    if mode == "tis":
        return rho.clamp(max=cap), no_rejection
    if mode == "mis":
        kept = rho <= cap
        return torch.where(kept, rho, 0.0), ~kept & real
    raise ValueError(f"unknown mismatch correction {mode!r}")


def mismatch_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mode: MismatchCorrection,
    cap: float,
    level: MismatchLevel = "token",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Importance weights for learner-vs-rollout mismatch, same shape as the log-probs (no gradient).

    rho = exp(old - rollout) per token; with LEVEL "sequence", rho of a row is exp of the sum of
    its log-ratios over the real tokens of MASK (all positions if MASK is None), the same for
    every position of the row. none: 1. tis: min(rho, cap). mis: rho if rho <= cap, else 0.
    """
    return _mismatch(old_logprobs, rollout_logprobs, mode, cap, level, mask)[0]


@dataclass(frozen=True)
class BatchTotals:
    """The denominators of a batch's loss: its real tokens and its non-empty sequences (each at least 1)."""

    tokens: int
    sequences: int

    @classmethod
    def of_lengths(cls, lengths: list[int]) -> BatchTotals:
        """From the completion lengths (real tokens per sequence) of the whole batch."""
        return cls(tokens=max(sum(lengths), 1), sequences=max(sum(1 for n in lengths if n > 0), 1))

    @classmethod
    def of_mask(cls, mask: torch.Tensor) -> BatchTotals:
        per_sequence = mask.bool().sum(dim=-1)
        return cls(tokens=max(int(per_sequence.sum()), 1), sequences=max(int((per_sequence > 0).sum()), 1))


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    max_tokens: int | None = None,
    totals: BatchTotals | None = None,
) -> torch.Tensor:
    """Reduce [B, T] per-token values to a scalar over the real tokens (modes: module docstring).

    TOTALS: the denominators of the whole batch when [B, T] is one micro-batch of it (default:
    this batch's own). Masked positions are dropped with `torch.where`, so NaN / inf there
    does not propagate. An empty batch gives 0.
    """
    real = mask.bool()
    values = torch.where(real, per_token, 0.0)
    totals = totals or BatchTotals.of_mask(real)
    if mode == "token_mean":
        return values.sum() / totals.tokens
    counts, sequences = real.sum(dim=-1), totals.sequences
    if mode == "sequence_mean":
        return (values.sum(dim=-1) / counts.clamp(min=1)).sum() / sequences
    if mode == "token_sum_norm":
        if max_tokens is None:
            raise ValueError("token_sum_norm aggregation needs max_tokens (the rollout's generation limit)")
        return values.sum() / (sequences * max_tokens)
    raise ValueError(f"unknown loss aggregation {mode!r}")


@dataclass(frozen=True)
class LossConfig:
    """Loss settings; `__post_init__` rejects invalid values with an error naming the field."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_beta: float = 0.0
    aggregation: LossAggregation = "token_mean"
    correction: MismatchCorrection = "tis"
    is_cap: float = 2.0  # C of TIS / MIS
    max_tokens: int | None = None  # required for token_sum_norm: the rollout's max_tokens
    mismatch_level: MismatchLevel = "token"  # rho per token, or one rho (product of the ratios) per sequence
    dual_clip: float | None = 3.0  # dual-clip PPO (verl clip_ratio_c): A < 0 loses at most -A * dual_clip per token
    kl_clamp: float | None = 10.0  # bound on the per-token k3 estimate (verl low_var_kl: 10)

    def __post_init__(self) -> None:
        for name, allowed in (("aggregation", LossAggregation), ("correction", MismatchCorrection),
                              ("mismatch_level", MismatchLevel)):  # fmt: skip
            if getattr(self, name) not in get_args(allowed):
                raise ValueError(f"{name} must be one of {get_args(allowed)}, got {getattr(self, name)!r}")
        if self.aggregation == "token_sum_norm" and self.max_tokens is None:
            raise ValueError("aggregation token_sum_norm needs max_tokens (the rollout's generation limit)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.is_cap <= 1:
            raise ValueError(f"is_cap must be > 1, got {self.is_cap}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or None to disable it), got {self.dual_clip}")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"kl_clamp must be > 0 (or None to disable it), got {self.kl_clamp}")


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # [B, T] learner, with grad
    old_logprobs: torch.Tensor  # [B, T] learner before this update
    rollout_logprobs: torch.Tensor  # [B, T] rollout engine's, for the sampled tokens
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T]
    ref_logprobs: torch.Tensor | None = None  # [B, T], needed when kl_beta > 0
    totals: BatchTotals | None = None  # the whole batch's denominators when this is one micro-batch of it


@dataclass
class LossOutputs:
    """The loss and per-batch statistics; every share is over the real tokens (of the whole
    batch when LossInputs.totals is given, so the micro-batches' values add up)."""

    loss: torch.Tensor
    policy_loss: float
    kl: float
    clip_fraction: float  # share of tokens where the min chose the clipped term (it was strictly smaller)
    is_weight_mean: float  # mean mismatch weight (none: 1; tis: min(rho, C); mis: rho, 0 where rejected)
    dual_clip_fraction: float = 0.0  # share of tokens (A < 0) whose loss the dual clip capped
    mis_rejected_fraction: float = 0.0  # share of tokens MIS rejected (weight 0)
    is_over_cap_fraction: float = 0.0  # share of tokens whose rho exceeds is_cap, whatever the correction (TIS truncates them)


def grpo_loss(inputs: LossInputs, config: LossConfig) -> LossOutputs:
    """Clipped surrogate (optionally dual-clipped) times per-token mismatch weights, plus beta * k3 KL, aggregated.

    Per real token, with r = exp(logprobs - old_logprobs) and A the sequence's advantage:
    objective = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); with dual clip, for A < 0,
    objective = max(objective, dual_clip * A) (a token with r > dual_clip gets a bounded loss and
    no gradient); loss = -objective * mismatch weight.
    """
    real = inputs.mask.bool()

    def clean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(real, x, 0.0)

    logprobs = clean(inputs.logprobs)
    old_logprobs = clean(inputs.old_logprobs.detach())
    ratio = torch.exp(logprobs - old_logprobs)
    advantages = inputs.advantages.to(logprobs.dtype).unsqueeze(1)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    clip_chosen = clipped < unclipped
    dual_capped = torch.zeros_like(real)
    if config.dual_clip is not None:
        floor = config.dual_clip * advantages
        dual_capped = (advantages < 0) & (objective < floor)
        objective = torch.where(dual_capped, floor, objective)
    weights, rejected, log_ratio = _mismatch(
        old_logprobs, clean(inputs.rollout_logprobs.detach()), config.correction, config.is_cap, config.mismatch_level, real
    )
    per_token = -objective * weights
    totals = inputs.totals or BatchTotals.of_mask(real)
    policy = aggregate(per_token, real, config.aggregation, config.max_tokens, totals)
    loss = policy
    kl_value = 0.0
    if config.kl_beta > 0:
        if inputs.ref_logprobs is None:
            raise ValueError("kl_beta > 0 needs reference log-probs")
        kl_tokens = k3_kl_penalty(logprobs, clean(inputs.ref_logprobs), config.kl_clamp)
        kl = aggregate(kl_tokens, real, config.aggregation, config.max_tokens, totals)
        loss = loss + config.kl_beta * kl
        kl_value = float(kl.detach())
    elif inputs.ref_logprobs is not None:  # reported only
        kl_tokens = k3_kl_penalty(logprobs.detach(), clean(inputs.ref_logprobs), config.kl_clamp)
        kl_value = float(aggregate(kl_tokens, real, "token_mean", totals=totals))

    tokens = totals.tokens

    def share(flags: torch.Tensor) -> float:
        return float((flags & real).sum() / tokens)

    return LossOutputs(
        loss=loss,
        policy_loss=float(policy.detach()),
        kl=kl_value,
        clip_fraction=share(clip_chosen),
        is_weight_mean=float(torch.where(real, weights, 0.0).sum() / tokens),
        dual_clip_fraction=share(dual_capped),
        mis_rejected_fraction=share(rejected),
        is_over_cap_fraction=share(log_ratio > math.log(config.is_cap)),
    )
