"""Undoing a step that failed, so a checkpoint never mixes two steps.

An RL step changes the learner (adapter weights, AdamW moments, LR schedule) before it is
committed (adapter published, synced, recorded). If the commit fails - a full disk, a
SyncError, a second Ctrl-C - the run stops; the checkpoint it leaves must describe ONE
state. `StepSnapshot` copies everything a step changes, before it starts, and puts it back: the
run then stops at the previous step, and a resume redoes the failed one exactly (same
prompts, same seeds, same dropout masks). LoRA makes this cheap: adapter and optimizer
state are megabytes.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import torch

from orbit_runtime.trainer.checkpointing import capture_cuda_rng, restore_cuda_rng


@dataclass
class StepSnapshot:
    adapter: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    sampler: dict  # PromptSampler.state_dict()
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor]  # empty without CUDA
    python_rng: tuple

    @classmethod
    def capture(cls, policy, optimizer, scheduler, sampler_state: dict) -> StepSnapshot:
        return cls(
            adapter=policy.adapter_state(),
            optimizer=copy.deepcopy(optimizer.state_dict()),
            scheduler=copy.deepcopy(scheduler.state_dict()),
            sampler=sampler_state,
            torch_rng=torch.get_rng_state(),
            cuda_rng=capture_cuda_rng(),
            python_rng=random.getstate(),
        )

    def restore(self, policy, optimizer, scheduler) -> dict:
        """Put the learner and the RNGs back; returns the sampler state for the caller to rebuild its sampler."""
        policy.load_adapter_state(self.adapter)
        optimizer.load_state_dict(self.optimizer)
        scheduler.load_state_dict(self.scheduler)
        torch.set_rng_state(self.torch_rng)
        restore_cuda_rng(self.cuda_rng)
        random.setstate(self.python_rng)
        return self.sampler
