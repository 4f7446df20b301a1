"""Train-rollout mismatch: how far the learner's token log-probs are from the rollout engine's.

Pure functions over per-token log-probs of the same sampled tokens. The k3 estimator of
KL(rollout || learner) is unbiased for samples drawn from the rollout policy and always >= 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from orbit_runtime.algorithms.grpo import k3_kl_penalty


@dataclass(frozen=True)
class MismatchStats:
    """Mean and max |learner logp - rollout logp|, k3 KL estimate, and the token count."""

    mean_abs_dlogp: float
    max_abs_dlogp: float
    k3_kl: float
    tokens: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def k3_kl(learner_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(rollout || learner): r - 1 - log r, r = p_learner / p_rollout
    (the loss's k3 with the rollout as the sampling policy and the learner as the other)."""
    return k3_kl_penalty(rollout_logprobs.double(), learner_logprobs.double())


def measure_mismatch(learner: list[torch.Tensor], rollout: list[torch.Tensor],
                     masks: list[torch.Tensor] | None = None) -> MismatchStats:  # fmt: skip
    """Stats over all tokens of all sequences; LEARNER[i] and ROLLOUT[i] score the same tokens.
    MASKS (multi-turn episodes): only tokens where MASKS[i] is true count (the model's, not the
    environment's, which have no rollout log-prob)."""
    if len(learner) != len(rollout):
        raise ValueError(f"{len(learner)} learner sequences vs {len(rollout)} rollout sequences")
    for i, (a, b) in enumerate(zip(learner, rollout, strict=True)):
        if a.shape != b.shape:
            raise ValueError(f"sequence {i}: learner scored {tuple(a.shape)} tokens, rollout {tuple(b.shape)}")
    lp_learner = torch.cat([t.detach().double().flatten() for t in learner])
    lp_rollout = torch.cat([t.detach().double().flatten() for t in rollout])
    if masks is not None:
        keep = torch.cat([m.bool().flatten() for m in masks])
        if keep.numel() != lp_learner.numel():
            raise ValueError(f"masks cover {keep.numel()} tokens, the sequences {lp_learner.numel()}")
        lp_learner, lp_rollout = lp_learner[keep], lp_rollout[keep]
    if lp_learner.numel() == 0:
        raise ValueError("no tokens to compare")
    delta = (lp_learner - lp_rollout).abs()
    return MismatchStats(
        mean_abs_dlogp=float(delta.mean()),
        max_abs_dlogp=float(delta.max()),
        k3_kl=float(k3_kl(lp_learner, lp_rollout).mean()),
        tokens=int(delta.numel()),
    )
