"""How the learner splits a rollout batch: PPO minibatches (one optimizer step each) and,
inside each, micro-batches under a token budget (one forward/backward each, gradients
accumulated).

A micro-batch is padded to its longest sequence, so samples are length-bucketed: sorted
longest first and packed greedily while `rows x longest` stays within the budget. Padding
is then at most the length spread inside a bucket, and the number of forwards is small.
The split never changes the result: losses are normalised by the whole minibatch's totals
(`algorithms.grpo.BatchTotals`), so the accumulated gradient equals one big batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatchLimits:
    """Caps on one forward/backward: padded tokens (rows x longest sequence) and rows; None: no cap."""

    max_tokens: int | None = None
    max_samples: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices into LENGTHS (sequence lengths, prompt + completion) grouped into micro-batches.

        Every index appears exactly once. Longest first; a micro-batch takes the next sample
        while (rows + 1) x its first (longest) length fits max_tokens and rows < max_samples.
        A sequence longer than max_tokens forms a micro-batch of its own (it cannot be split).
        """
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        groups: list[list[int]] = []
        for index in order:
            if groups:
                group = groups[-1]
                rows, width = len(group) + 1, lengths[group[0]]
                fits_tokens = self.max_tokens is None or rows * width <= self.max_tokens
                fits_rows = self.max_samples is None or rows <= self.max_samples
                if fits_tokens and fits_rows:
                    group.append(index)
                    continue
            groups.append([index])
        return groups


def split_minibatches(count: int, minibatches: int) -> list[list[int]]:
    """Indices 0..COUNT-1, in order, as MINIBATCHES contiguous chunks whose sizes differ by at most one.

    In order, so a GRPO group stays together whenever the batch divides evenly.
    """
    if minibatches < 1:
        raise ValueError(f"minibatches must be >= 1, got {minibatches}")
    if minibatches > count:
        raise ValueError(f"cannot split {count} samples into {minibatches} minibatches (algorithm.minibatches)")
    base, extra = divmod(count, minibatches)
    chunks, start = [], 0
    for k in range(minibatches):
        size = base + (1 if k < extra else 0)
        chunks.append(list(range(start, start + size)))
        start += size
    return chunks


Pairs = Sequence[tuple[list[int], list[int]]]


def sequence_lengths(pairs: Pairs) -> list[int]:
    """Prompt + completion length of each (prompt ids, completion ids) pair."""
    return [len(p) + len(c) for p, c in pairs]


def logprobs_in_micro_batches(policy, pairs: Pairs, limits: MicroBatchLimits, temperature: float,
                              around: Callable[[list[int]], AbstractContextManager] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """policy.completion_logprobs of PAIRS, one micro-batch at a time, in the order of PAIRS.

    For scoring without gradients (old log-probs, the shared reference): only one
    micro-batch's activations and logits are alive at a time. AROUND(indices), if given, is a
    context each micro-batch's forward runs in (routing replay installs the rollout's experts).
    """
    rows: list[torch.Tensor | None] = [None] * len(pairs)
    for group in limits.plan(sequence_lengths(pairs)):
        with around(group) if around is not None else contextlib.nullcontext():
            scored = policy.completion_logprobs([pairs[i] for i in group], temperature=temperature)
        for i, row in zip(group, scored, strict=True):
            rows[i] = row.detach().clone()  # a copy: a view would keep the micro-batch's whole [B, T] alive
    return rows  # type: ignore[return-value]


NO_LIMITS = MicroBatchLimits()  # the whole batch in one forward/backward
