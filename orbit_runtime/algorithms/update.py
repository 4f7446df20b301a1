"""One policy update on a rollout batch: the learner's log-probs at the sampling temperature,
the GRPO loss, and AdamW on the adapter. No I/O and no run state: the trainer decides what
happens around it (snapshots, publishing, recording).

Old log-probs (the policy before this update, PPO's denominator) and the train-rollout
mismatch are taken in scoring mode (dropout off), the update passes in training mode. When
the adapter has no dropout the two modes compute the same numbers, so the first update
pass's log-probs are reused as the old ones instead of running a separate forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from orbit_runtime.algorithms.grpo import LossConfig, LossInputs, grpo_loss
from orbit_runtime.learner.mismatch import MismatchStats, measure_mismatch

Pairs = list[tuple[list[int], list[int]]]


def pad(rows: list[torch.Tensor]) -> torch.Tensor:
    """Right-pad per-sequence vectors into [B, T] float32 (padding 0; the loss masks it)."""
    return pad_sequence([r.float() for r in rows], batch_first=True)


@dataclass
class UpdateBatch:
    """What one update trains on: completions with the rollout's log-probs and their advantages."""

    pairs: Pairs  # (prompt ids, completion ids) per sample
    rollout_logprobs: list[torch.Tensor]  # the rollout engine's log-probs of each completion's tokens
    advantages: torch.Tensor  # [B]
    ref_logprobs: list[torch.Tensor] | None = None  # reference log-probs (needed when kl_beta > 0)


@dataclass
class UpdateResult:
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    is_weight_mean: float
    dual_clip_fraction: float
    mis_rejected_fraction: float
    grad_norm: float  # before clipping, last optimizer step
    mismatch: MismatchStats  # learner (before the update) vs rollout, same tokens
    optimizer_steps: int


def policy_update(
    policy,
    optimizer: torch.optim.Optimizer,
    batch: UpdateBatch,
    loss_config: LossConfig,
    *,
    temperature: float,
    max_grad_norm: float,
    epochs: int = 1,
    before_first_optimizer_step: Callable[[], None] | None = None,
) -> UpdateResult:
    """EPOCHS optimizer steps over BATCH. BEFORE_FIRST_OPTIMIZER_STEP runs once, right before the
    adapter is first modified (the trainer uses it to stop accepting interruptions)."""
    rollout = pad(batch.rollout_logprobs)
    mask = pad([torch.ones(len(c)) for _, c in batch.pairs])
    ref = pad(batch.ref_logprobs) if batch.ref_logprobs is not None else None
    old: torch.Tensor | None = None
    mismatch: MismatchStats | None = None
    if policy.has_dropout:
        with policy.scoring():
            old_rows = policy.completion_logprobs(batch.pairs, temperature=temperature)
        old, mismatch = pad(old_rows), measure_mismatch(old_rows, batch.rollout_logprobs)
    for epoch in range(epochs):
        with policy.training():  # also through backward: checkpointed layers recompute in the same mode
            rows = policy.completion_logprobs(batch.pairs, temperature=temperature)
            new = pad(rows)
            if old is None:
                old, mismatch = new.detach(), measure_mismatch([r.detach() for r in rows], batch.rollout_logprobs)
            out = grpo_loss(LossInputs(new, old, rollout, batch.advantages, mask, ref), loss_config)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        if epoch == 0 and before_first_optimizer_step is not None:
            before_first_optimizer_step()
        optimizer.step()
    return UpdateResult(
        loss=float(out.loss.detach()),
        policy_loss=out.policy_loss,
        kl=out.kl,
        clip_fraction=out.clip_fraction,
        is_weight_mean=out.is_weight_mean,
        dual_clip_fraction=out.dual_clip_fraction,
        mis_rejected_fraction=out.mis_rejected_fraction,
        grad_norm=grad_norm,
        mismatch=mismatch,
        optimizer_steps=epochs,
    )
