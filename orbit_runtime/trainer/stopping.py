"""SIGTERM (the pod is being stopped) and Ctrl-C: stop the run without losing or mixing state.

While nothing of the run's state has changed (generating, scoring, before the optimizer
touches the adapter), a stop signal interrupts at once: the step is abandoned and redone
after a resume. After that, the step completes and the run stops between steps. A second
Ctrl-C interrupts anywhere except inside `deferred()` blocks; the trainer then rolls the
half-done step back (see rollback), itself a deferred block.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Stopped(Exception):
    """SIGTERM or Ctrl-C: stop after cleaning up."""


class StopController:
    def __init__(self) -> None:
        self.signal: int | None = None
        self.interruptible = False  # may a stop signal abort the current work right away?
        self._deferred = 0  # > 0 while a rollback or the final checkpoint must not be interrupted
        self._previous: dict = {}

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def uninstall(self) -> None:
        self.interruptible = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def commit_started(self) -> None:
        """From here on the step completes (or is rolled back): no interruption on the first signal."""
        self.interruptible = False

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Signals are recorded but never raise inside this block (undoing a step, staging the
        last checkpoint): an interruption there would leave a state that mixes two steps."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1

    def check(self) -> None:
        """Between steps: honour a signal that arrived while the step could not be interrupted."""
        if self.signal is not None:
            raise Stopped(f"signal {self.signal}")

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "none"

    def _on_signal(self, signum, frame) -> None:
        if self._deferred:
            self.signal = self.signal or signum
            return
        if self.signal is not None and signum == signal.SIGINT:
            raise Stopped(f"signal {signum}")  # a second Ctrl-C: the user is not waiting any longer
        self.signal = signum
        if self.interruptible:
            self.interruptible = False
            raise Stopped(f"signal {signum}")
