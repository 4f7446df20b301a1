"""Deterministic prompt order: a fresh seeded permutation per epoch and a cursor into it.

The (seed, epoch, position) triple is the whole state, so a resumed run continues with
exactly the prompts it would have seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class PromptSampler:
    size: int
    seed: int = 0
    epoch: int = 0
    position: int = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, count: int) -> list[int]:
        """Indices of the next COUNT prompts, crossing epoch boundaries as needed."""
        out: list[int] = []
        order = self._order(self.epoch)
        while len(out) < count:
            if self.position >= self.size:
                self.epoch += 1
                self.position = 0
                order = self._order(self.epoch)
            take = min(count - len(out), self.size - self.position)
            out.extend(order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"size": self.size, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state(cls, state: dict[str, int]) -> PromptSampler:
        return cls(**state)
