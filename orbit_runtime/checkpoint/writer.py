"""Upload checkpoints in the background, so training never waits on storage.

The learner writes a checkpoint to a local staging directory (fast, consistent: it is taken
between steps) and submits it. One uploader thread commits it to the catalog (files, then
manifest), applies retention and removes torn step directories. If storage is down the
upload fails after botocore's own retries; the thread keeps the checkpoint and tries again
with exponential backoff while training goes on. A newer checkpoint replaces an older one
that has not landed yet: there is one pending checkpoint at most, and it is the newest.

The training thread learns what happened through `events()` (to record metrics) and the
counters on `stats`; it waits for the last checkpoint with `wait(timeout)` when stopping.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from orbit_runtime.checkpoint.catalog import CheckpointCatalog
from orbit_runtime.redaction import redact

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedCheckpoint:
    step: int
    local_dir: Path
    meta: dict  # goes into the manifest (config hash, adapter version, score, ...)


@dataclass
class WriterStats:
    attempts: int = 0
    failures: int = 0  # attempts that failed after the storage client's retries
    successes: int = 0
    consecutive_failures: int = 0
    last_success_step: int | None = None
    last_success_time: float | None = None  # unix time
    last_seconds: float = 0.0
    last_bytes: int = 0
    last_error: str | None = None
    deleted: list[int] = field(default_factory=list)


class CheckpointWriter:
    def __init__(
        self, catalog: CheckpointCatalog, *, keep_last: int, keep_best: int, backoff_s: tuple[float, float] = (2.0, 60.0)
    ) -> None:
        self.catalog = catalog
        self.keep_last, self.keep_best = keep_last, keep_best
        self.backoff_s = backoff_s
        self.stats = WriterStats()
        self._cond = threading.Condition()
        self._pending: StagedCheckpoint | None = None
        self._inflight: StagedCheckpoint | None = None
        self._urgent = False  # someone is waiting: skip the backoff
        self._closing = False
        self._events: list[dict] = []
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    # ---- training thread -----------------------------------------------------------------
    def submit(self, staged: StagedCheckpoint) -> None:
        """Queue STAGED for upload; an older checkpoint still waiting is dropped (this one is newer)."""
        with self._cond:
            replaced = self._pending
            self._pending = staged
            if replaced is not None and replaced is not self._inflight:
                shutil.rmtree(replaced.local_dir, ignore_errors=True)
            self._cond.notify_all()

    @property
    def pending_step(self) -> int | None:
        with self._cond:
            return self._pending.step if self._pending else None

    def wait(self, timeout_s: float) -> bool:
        """Block until nothing is pending (True) or TIMEOUT_S passed (False). Retries without backoff meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._urgent = True
            self._cond.notify_all()
            try:
                while self._pending is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._urgent = False

    def events(self) -> list[dict]:
        """What happened since the last call: one dict per upload attempt."""
        with self._cond:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        """Stop the thread after its current attempt; an unfinished upload stays torn (and is ignored)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    # ---- uploader thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                job = self._inflight = self._pending
            ok = self._attempt(job)
            with self._cond:
                self._inflight = None
                if ok and self._pending is job:
                    self._pending = None
                if self._pending is not job:  # landed, or replaced by a newer checkpoint
                    shutil.rmtree(job.local_dir, ignore_errors=True)
                self._cond.notify_all()
                if not ok and self._pending is job and not self._closing:
                    low, high = self.backoff_s
                    delay = 0.5 if self._urgent else min(high, low * 2 ** (self.stats.consecutive_failures - 1))
                    self._cond.wait(delay)  # a newer submit, wait() or close() wakes us early

    def _attempt(self, job: StagedCheckpoint) -> bool:
        started = time.monotonic()
        self.stats.attempts += 1
        event = {"kind": "checkpoint", "step": job.step, "uri": self.catalog.entry_uri(job.step)}
        try:
            entry = self.catalog.write(job.step, job.local_dir, job.meta)
        except Exception as exc:  # storage down, disk full, ...: never kills training
            self.stats.failures += 1
            self.stats.consecutive_failures += 1
            self.stats.last_error = redact(f"{type(exc).__name__}: {exc}")
            log.warning(
                "checkpoint of step %d to %s failed (%d in a row, %d in total): %s; training goes on, it will be retried",
                job.step, self.catalog.uri, self.stats.consecutive_failures, self.stats.failures, self.stats.last_error,
            )  # fmt: skip
            self._emit({**event, "ok": False, "seconds": time.monotonic() - started, "error": self.stats.last_error})
            return False
        seconds = time.monotonic() - started
        size = sum(entry.sizes.values())
        self.stats.successes += 1
        self.stats.consecutive_failures = 0
        self.stats.last_success_step, self.stats.last_success_time = job.step, time.time()
        self.stats.last_seconds, self.stats.last_bytes = seconds, size
        deleted = self._housekeeping(job.step)
        log.info("checkpoint of step %d landed at %s (%.1f MB in %.2fs)", job.step, entry.uri, size / 1e6, seconds)
        self._emit({**event, "ok": True, "seconds": seconds, "bytes": size, "deleted_steps": deleted})
        return True

    def _housekeeping(self, step: int) -> list[int]:
        """Retention and torn-directory cleanup; a failure here only delays cleanup."""
        try:
            removed = self.catalog.clean(self.keep_last, self.keep_best)
        except Exception as exc:
            log.warning("checkpoint cleanup after step %d failed (will retry next time): %s", step, redact(str(exc)))
            return []
        steps = sorted(e.step for e in removed)
        self.stats.deleted.extend(steps)
        return steps

    def _emit(self, event: dict) -> None:
        with self._cond:
            self._events.append({"time": time.time(), **event, "failures_total": self.stats.failures})
