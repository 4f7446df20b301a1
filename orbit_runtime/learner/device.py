"""Where the learner runs: `learner.device` resolved against what torch sees."""

from __future__ import annotations

import torch

from orbit_runtime.errors import OrbitError


def resolve_device(requested: str) -> torch.device:
    """auto -> cuda:0 if torch sees a GPU, else cpu; cuda without a GPU is a config error naming the field."""
    has_cuda = torch.cuda.is_available()
    if requested == "auto":
        return torch.device("cuda", 0) if has_cuda else torch.device("cpu")
    if requested == "cuda":
        if not has_cuda:
            build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
            raise OrbitError(
                f"learner.device is cuda, but torch {torch.__version__} ({build}) sees no CUDA device; "
                "use learner.device: auto or cpu"
            )
        return torch.device("cuda", 0)
    if requested == "cpu":
        return torch.device("cpu")
    raise OrbitError(f"learner.device must be auto, cpu or cuda, got {requested!r}")
