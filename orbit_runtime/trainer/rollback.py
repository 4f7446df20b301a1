"""Undoing an update whose commit failed, so a checkpoint never mixes two steps.

An RL step changes the learner (adapter weights, AdamW moments, LR schedule) before it is
committed (adapter published, synced, recorded). If the commit fails - a full disk, a
SyncError, a second Ctrl-C - the run stops; the checkpoint it leaves must describe ONE
state. `LearnerSnapshot` copies everything an update changes, before it changes it, and puts
it back: the run then stops at the previous step, and a resume redoes the failed one
exactly (same prompts, same seeds). LoRA makes this cheap: adapter and optimizer state are
megabytes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class LearnerSnapshot:
    adapter: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    sampler: dict
    rng: tuple

    @classmethod
    def capture(cls, policy, optimizer, scheduler, sampler_state: dict, rng: tuple) -> LearnerSnapshot:
        return cls(
            adapter=policy.adapter_state(),
            optimizer=copy.deepcopy(optimizer.state_dict()),
            scheduler=copy.deepcopy(scheduler.state_dict()),
            sampler=sampler_state,
            rng=rng,
        )

    def restore(self, policy, optimizer, scheduler) -> None:
        """Put the learner back (the caller restores sampler and RNG, which it owns)."""
        policy.load_adapter_state(self.adapter)
        optimizer.load_state_dict(self.optimizer)
        scheduler.load_state_dict(self.scheduler)
