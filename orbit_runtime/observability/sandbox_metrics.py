"""Metrics of the code sandbox (`orbit_runtime/sandbox`), on the learner's registry: programs
judged per status, time in the sandbox, and sandbox failures (the sandbox could not judge),
which are not program failures."""

from __future__ import annotations

import collections
import threading

from prometheus_client import Counter, Histogram

from orbit_runtime.observability.metrics import LEARNER_REGISTRY
from orbit_runtime.sandbox.bwrap import STATUSES

CODE_PROGRAMS = Counter(
    "orbit_code_programs_total", "Programs judged in the sandbox, by status (ok, timeout, memory, ...).",
    ["status"], registry=LEARNER_REGISTRY,
)  # fmt: skip
CODE_SANDBOX_SECONDS = Histogram(
    "orbit_code_sandbox_seconds", "Wall time of judging one program (sandbox start to verdict).",
    buckets=(0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30), registry=LEARNER_REGISTRY,
)  # fmt: skip
CODE_SANDBOX_FAILURES = Counter(
    "orbit_code_sandbox_failures_total", "Programs the sandbox could not judge (bwrap missing or refused; not the program's fault).",
    registry=LEARNER_REGISTRY,
)  # fmt: skip
for _status in STATUSES:
    CODE_PROGRAMS.labels(_status)
_since_last_step: collections.Counter = collections.Counter()  # statuses judged since the last step row
_lock = threading.Lock()  # programs are judged from worker threads


def observe_code_verdict(status: str, seconds: float) -> None:
    CODE_PROGRAMS.labels(status).inc()
    with _lock:
        _since_last_step[status] += 1
    CODE_SANDBOX_SECONDS.observe(seconds)
    if status == "sandbox_error":
        CODE_SANDBOX_FAILURES.inc()


def take_step_counts() -> dict[str, int]:
    """Programs judged per status since the last call (the trainer's step row: `code_programs`)."""
    with _lock:
        counts = dict(_since_last_step)
        _since_last_step.clear()
    return counts
