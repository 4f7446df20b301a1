"""Reconciles due later: what `Plan.requeue_after` asks for (a running learner's next poll, a
backoff's end, a TTL), else a slow resync. One entry per job, the earliest due wins; a few
worker threads run the due ones, never two at once for one job (one due while its reconcile
runs is run right after it).

This replaces a per-job kopf timer: a timer costs every job, terminal ones included, a full
reconcile every few seconds (and makes kopf put a finalizer on every job); here a job costs
requests when something is due for it (a running learner's poll), when it or one of its pods
changed (handlers.on_pod_event), and at the slow resync.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from orbit_runtime.observability import metrics

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (namespace, name)
RETRY_AFTER_CRASH_SECONDS = 30.0


class RequeueScheduler:
    def __init__(self, run: Callable[[str, str], None], workers: int = 4) -> None:
        self._run = run
        self._due: dict[Key, float] = {}  # key -> monotonic time it is due (the earliest asked for)
        self._heap: list[tuple[float, Key]] = []  # may hold stale entries: _due is the truth
        self._running: set[Key] = set()
        self._again: set[Key] = set()  # asked for while running: once more right after
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="orbit-reconcile")
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="orbit-requeue", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def schedule(self, namespace: str, name: str, delay: float) -> None:
        """Reconcile the job in DELAY seconds, unless it is already due sooner."""
        key, due = (namespace, name), time.monotonic() + max(0.0, delay)
        with self._cond:
            if key in self._running and delay <= 0:
                self._again.add(key)
                return
            if key in self._due and self._due[key] <= due:
                return
            self._due[key] = due
            heapq.heappush(self._heap, (due, key))
            metrics.OPERATOR_REQUEUED_JOBS.set(len(self._due))
            self._cond.notify()

    def forget(self, namespace: str, name: str) -> None:
        with self._cond:
            self._due.pop((namespace, name), None)
            self._again.discard((namespace, name))
            metrics.OPERATOR_REQUEUED_JOBS.set(len(self._due))

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                while self._heap and (self._due.get(self._heap[0][1]) != self._heap[0][0]):
                    heapq.heappop(self._heap)  # stale: rescheduled sooner, or forgotten
                if not self._heap:
                    self._cond.wait()
                    continue
                due, key = self._heap[0]
                if due > now:
                    self._cond.wait(due - now)
                    continue
                heapq.heappop(self._heap)
                del self._due[key]
                if key in self._running:  # never two at once for one job: once more right after this one
                    self._again.add(key)
                    continue
                self._running.add(key)
                metrics.OPERATOR_REQUEUED_JOBS.set(len(self._due))
            self._pool.submit(self._work, key)

    def _work(self, key: Key) -> None:
        try:
            self._run(*key)
        except Exception:  # noqa: BLE001 - RUN schedules its own retries; this is a bug in it: try again later
            log.exception("reconcile of %s/%s failed", *key)
            self.schedule(*key, RETRY_AFTER_CRASH_SECONDS)
        finally:
            with self._cond:
                self._running.discard(key)
                again = key in self._again
                self._again.discard(key)
            if again:
                self.schedule(*key, 0.0)
