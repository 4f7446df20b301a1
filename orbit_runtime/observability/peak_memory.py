"""Peak memory of the learner over one step: the process's resident set on the CPU, and
allocated / reserved memory on its CUDA device.

The CPU peak is Linux's VmHWM, reset at the start of each step by writing 5 to
/proc/self/clear_refs; where that is not allowed the peak is the process's lifetime high-water
mark (ru_maxrss), and `rss_peak_is_per_step` says so. Where the step started (resident set,
CUDA memory allocated) is recorded too: the peak minus the start is what the step added, which
`orbit plan --compare` sets against the plan.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """`reset()` at a step's start, `read()` at its end: the step's peaks in bytes."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.rss_peak_is_per_step = False
        self.start: dict[str, int] = {}

    def reset(self) -> None:
        self.start = {"rss_at_step_start_bytes": _status_bytes("VmRSS") or 0}
        if self.device.type == "cuda":
            self.start["cuda_allocated_at_step_start_bytes"] = torch.cuda.memory_allocated(self.device)
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.rss_peak_is_per_step = _status_bytes("VmHWM") is not None
        except OSError:
            self.rss_peak_is_per_step = False
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, int]:
        """{"peak_rss_bytes": ...} plus, on CUDA, "cuda_peak_allocated_bytes" and "cuda_peak_reserved_bytes",
        and where the step started (see the module docstring)."""
        rss = _status_bytes("VmHWM") if self.rss_peak_is_per_step else None
        if rss is None:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        out = {"peak_rss_bytes": rss, **self.start}
        if self.device.type == "cuda":
            out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            out["cuda_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        return out
