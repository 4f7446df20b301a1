"""One policy update on a rollout batch: the learner's log-probs at the sampling temperature,
the GRPO loss, and AdamW on the adapter. No I/O and no run state: the trainer decides what
happens around it (snapshots, publishing, recording).

The batch is passed over `epochs` times; each pass is split into `minibatches` optimizer
steps (PPO minibatches), and each minibatch into micro-batches under the learner's token
budget (one forward/backward each, gradients accumulated; see learner/micro_batches.py).
Loss normalisers are the minibatch's, so micro-batching never changes the update.

Old log-probs (the policy before this update, PPO's denominator) and the train-rollout
mismatch are taken in scoring mode (dropout off), the update passes in training mode. When
the adapter has no dropout and the whole batch is one optimizer step per pass, the two
modes compute the same numbers before the first step, so the first pass's log-probs are
reused as the old ones instead of running a separate forward.

With routing replay (a batch carrying the rollout's routed experts), every forward and the
backward that recomputes it use the rollout's experts (`routing_replay.py`); before the first
optimizer step the batch is scored once more with the learner's own routing, which gives the
routing agreement and the mismatch without replay (what replay removed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from orbit_runtime.algorithms.grpo import BatchTotals, LossConfig, LossInputs, LossOutputs, grpo_loss
from orbit_runtime.algorithms.mismatch import MismatchStats, measure_mismatch
from orbit_runtime.learner.micro_batches import (
    NO_LIMITS,
    MicroBatchLimits,
    logprobs_in_micro_batches,
    sequence_lengths,
    split_minibatches,
)
from orbit_runtime.learner.routing_replay import RoutingAgreement

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
    loss_mask: list[bool] | None = None  # False: the sample is left out of the loss and its denominators
    routed_experts: list[np.ndarray | None] | None = None  # replay: the rollout's experts per sample
    token_masks: list[torch.Tensor] | None = None  # episodes: True at the model's tokens, False at the environment's

    def routing(self, policy, indices: list[int], mode: str = "replay"):
        """The context a forward (and backward) of samples INDICES runs in: the rollout's experts
        installed when this batch replays routing, else nothing."""
        if self.routed_experts is None:
            return contextlib.nullcontext(None)
        pairs = [self.pairs[i] for i in indices]
        return _installed(policy, policy.routed_experts_for(pairs, [self.routed_experts[i] for i in indices], mode))

    def trained_length(self, index: int) -> int:
        """Completion tokens of sample INDEX that the loss counts (0 when it is masked)."""
        if self.loss_mask is not None and not self.loss_mask[index]:
            return 0
        return int(self.token_masks[index].sum()) if self.token_masks is not None else len(self.pairs[index][1])

    def trained_tokens(self, index: int) -> torch.Tensor:
        """1.0 at the completion tokens of sample INDEX that the loss counts, 0.0 elsewhere."""
        length = len(self.pairs[index][1])
        if self.loss_mask is not None and not self.loss_mask[index]:
            return torch.zeros(length)
        return self.token_masks[index].float() if self.token_masks is not None else torch.ones(length)


@dataclass
class UpdateResult:
    """The update's statistics: losses and shares are means over its optimizer steps."""

    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    is_weight_mean: float
    dual_clip_fraction: float
    mis_rejected_fraction: float
    is_over_cap_fraction: float
    grad_norm: float  # before clipping
    mismatch: MismatchStats  # learner (before the update) vs rollout, same tokens
    optimizer_steps: int
    micro_batches: int  # forward/backward passes of the update
    unreplayed_mismatch: MismatchStats | None = None  # replay: the mismatch with the learner's own routing
    routing_agreement: RoutingAgreement | None = None  # replay: the learner's own experts vs the rollout's
    routing_missing: int = 0  # replay: samples whose routing did not come back (their own routing was used)


STAT_FIELDS = ("loss", "policy_loss", "kl", "clip_fraction", "is_weight_mean", "dual_clip_fraction",
               "mis_rejected_fraction", "is_over_cap_fraction", "grad_norm")  # grad_norm last: per optimizer step  # fmt: skip


def policy_update(
    policy,
    optimizer: torch.optim.Optimizer,
    batch: UpdateBatch,
    loss_config: LossConfig,
    *,
    temperature: float,
    max_grad_norm: float,
    epochs: int = 1,
    minibatches: int = 1,
    limits: MicroBatchLimits = NO_LIMITS,
    before_first_optimizer_step: Callable[[], None] | None = None,
) -> UpdateResult:
    """EPOCHS x MINIBATCHES optimizer steps over BATCH, in micro-batches under LIMITS.

    BEFORE_FIRST_OPTIMIZER_STEP runs once, right before the adapter is first modified (the
    trainer uses it to stop accepting interruptions).
    """
    count = len(batch.pairs)
    chunks = split_minibatches(count, minibatches)
    lengths = sequence_lengths(batch.pairs)
    old_rows: list[torch.Tensor | None] = [None] * count
    unreplayed, agreement, missing = None, None, 0
    if batch.routed_experts is not None:
        unreplayed_rows, agreement, missing = _score(policy, batch, limits, temperature, mode="compare")
        unreplayed = measure_mismatch(unreplayed_rows, batch.rollout_logprobs, batch.token_masks)
    if policy.has_dropout or minibatches > 1:
        old_rows, _, _ = _score(policy, batch, limits, temperature, mode="replay")
    totals = {name: 0.0 for name in STAT_FIELDS}
    steps = passes = 0
    for _ in range(epochs):
        for chunk in chunks:
            optimizer.zero_grad(set_to_none=True)
            batch_totals = BatchTotals.of_lengths([batch.trained_length(i) for i in chunk])
            step_stats = {name: 0.0 for name in STAT_FIELDS}
            for group in limits.plan([lengths[i] for i in chunk]):
                out = _accumulate(policy, batch, [chunk[j] for j in group], old_rows, batch_totals, loss_config, temperature)
                for name in STAT_FIELDS[:-1]:
                    step_stats[name] += float(out.loss.detach()) if name == "loss" else getattr(out, name)
                passes += 1
            params = [p for group in optimizer.param_groups for p in group["params"]]
            step_stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
            if steps == 0 and before_first_optimizer_step is not None:
                before_first_optimizer_step()
            optimizer.step()
            steps += 1
            for name in STAT_FIELDS:
                totals[name] += step_stats[name]
    mismatch = measure_mismatch([row.cpu() for row in old_rows], batch.rollout_logprobs, batch.token_masks)  # type: ignore[union-attr]
    return UpdateResult(**{name: value / steps for name, value in totals.items()}, mismatch=mismatch,
                        optimizer_steps=steps, micro_batches=passes, unreplayed_mismatch=unreplayed,
                        routing_agreement=agreement, routing_missing=missing)  # fmt: skip


@contextlib.contextmanager
def _installed(policy, routed):
    with policy.routed(routed):
        yield routed


def _score(policy, batch: UpdateBatch, limits: MicroBatchLimits, temperature: float, mode: str):
    """Log-probs of every sample without gradients, one micro-batch at a time, routed as MODE says
    ('replay': the rollout's experts; 'compare': the learner's own, counting agreement).
    Returns (rows in batch order, agreement or None, samples without routing)."""
    agreement = RoutingAgreement() if batch.routed_experts is not None else None
    missing = 0

    @contextlib.contextmanager
    def routed(group: list[int]):
        nonlocal missing
        with batch.routing(policy, group, mode) as installed:
            yield
        if installed is not None:
            agreement.add(installed.agreement)
            missing += installed.missing

    with policy.scoring():
        rows = logprobs_in_micro_batches(policy, batch.pairs, limits, temperature, around=routed)
    return [r.cpu() for r in rows], agreement, missing


def _accumulate(
    policy,
    batch: UpdateBatch,
    indices: list[int],
    old_rows: list[torch.Tensor | None],
    totals: BatchTotals,
    loss_config: LossConfig,
    temperature: float,
) -> LossOutputs:
    """Forward and backward of one micro-batch (samples INDICES), adding to the adapter's .grad.

    Old log-probs not computed yet (the reuse case, see the module docstring) are this pass's.
    """
    pairs = [batch.pairs[i] for i in indices]
    # also through backward: checkpointed layers recompute in the same mode, with the same experts
    with policy.training(), batch.routing(policy, indices):
        rows = policy.completion_logprobs(pairs, temperature=temperature)
        for i, row in zip(indices, rows, strict=True):
            if old_rows[i] is None:
                old_rows[i] = row.detach().clone()
        device = rows[0].device  # the learner's; the rollout's and reference's rows arrive on the CPU

        def padded(values: list[torch.Tensor]) -> torch.Tensor:
            return pad([v.to(device) for v in values])

        inputs = LossInputs(
            logprobs=pad(rows),
            old_logprobs=padded([old_rows[i] for i in indices]),  # type: ignore[misc]
            rollout_logprobs=padded([batch.rollout_logprobs[i] for i in indices]),
            advantages=batch.advantages[indices].to(device),
            mask=padded([batch.trained_tokens(i) for i in indices]),
            ref_logprobs=padded([batch.ref_logprobs[i] for i in indices]) if batch.ref_logprobs is not None else None,
            totals=totals,
        )
        out = grpo_loss(inputs, loss_config)
        out.loss.backward()
    return out
