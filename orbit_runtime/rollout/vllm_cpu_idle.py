"""vLLM's CPU processes stop polling when idle, so the learner gets the cores between rollouts.

vLLM's engine process and its worker pass every batch through shared-memory queues. A reader
that has read within the last second does not sleep on the queue's notification socket: it
busy-polls with `sched_yield` (`SpinCondition.wait` in vllm/distributed/device_communicators/
shm_broadcast.py, `busy_loop_s = 1`). On a GPU node that costs a spare core; on a CPU node where
the learner shares the cores with the rollout it costs the learner one of them after every
engine step and for a second after every request: measured on 2 cores during the quickstart,
the idle worker held a full core while the learner ran its reference pass and its update, and
the engine process held the other one while the worker generated.

Orbit's RL loop alternates (generate, then score and train, then sync), so the rollout is idle
exactly when the learner computes. `install` makes each reader poll for at most
ORBIT_VLLM_IDLE_SPIN_S seconds (default 0: sleep on the notification at once; vLLM's value is
1). Every write notifies the readers (`MessageQueue.enqueue` calls `notify`), so a sleeping
reader wakes for the next message; it costs one socket wake-up per message, microseconds
against an engine step of milliseconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable

IDLE_SPIN_ENV = "ORBIT_VLLM_IDLE_SPIN_S"
DEFAULT_IDLE_SPIN_S = 0.0


def idle_spin_seconds() -> float:
    """The busy-poll window ORBIT_VLLM_IDLE_SPIN_S asks for (seconds, >= 0)."""
    raw = os.environ.get(IDLE_SPIN_ENV)
    if raw is None or raw == "":
        return DEFAULT_IDLE_SPIN_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # also refuses nan
        raise ValueError(f"{IDLE_SPIN_ENV}={raw!r}: expected seconds (a number >= 0)")
    return seconds


def stock_wait() -> Callable[..., None]:
    """vLLM's own `SpinCondition.wait`, from under Orbit's cap where `install` has run in this process."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    return getattr(SpinCondition.wait, "__orbit_stock__", SpinCondition.wait)


def install(seconds: float) -> None:
    """Cap every shared-memory queue reader's busy-poll window at SECONDS in this process.

    `wait` is patched rather than the constructor: a queue created before the plugin loaded
    (a worker builds its input queue early) is capped too."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    stock = stock_wait()

    def wait(self, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = min(self.busy_loop_s, seconds)
        return stock(self, timeout_ms)

    wait.__orbit_stock__ = stock  # type: ignore[attr-defined]
    SpinCondition.wait = wait
