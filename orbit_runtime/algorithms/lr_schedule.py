"""Learning-rate multipliers per optimizer step: linear warm-up, then constant, linear or
cosine decay to `min_ratio` at `total` steps (the shapes verl and TRL users know). Pure."""

from __future__ import annotations

import math


def lr_multiplier(step: int, *, warmup: int, total: int, kind: str = "constant", min_ratio: float = 0.0) -> float:
    """Multiplier of the base LR for optimizer step STEP (0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if kind == "linear":
        shape = 1.0 - progress
    elif kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown LR schedule {kind!r}")
    return min_ratio + (1.0 - min_ratio) * shape
