"""The run's trackers behind one queue: the training thread enqueues and goes on; a thread of the
trackers' own opens them and makes every call. A call that raises is logged (a warning, with a
count per tracker) and counted in orbit_tracker_errors_total; a tracker that could not open is left
out; when the queue is full (a tracker far behind) records are dropped and counted. At the end the
thread is given a bounded time to finish (closing a W&B or MLflow run uploads what is left)."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from orbit_runtime.errors import OrbitError
from orbit_runtime.observability.tracker_metrics import TRACKER_DROPPED, TRACKER_ERRORS, TRACKER_SECONDS
from orbit_runtime.tracking.rows import row_metrics

log = logging.getLogger(__name__)

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
QUEUE_SIZE = 10_000
WARNINGS_PER_TRACKER = 5  # then one in every 100 failures


@dataclass(frozen=True)
class TrackingContext:
    """What a tracker needs to open: the run's directory, name and settings (config.run_outputs.RunSpec),
    its job spec as JSON (credentials masked), RESUMED_STEP (the checkpoint's step when the run resumed,
    else None) and RUN_IDS, the tracker run ids the run's checkpoints carry (the trainer's dict, updated
    in place as trackers open, so the next checkpoint carries the new ones)."""

    run_dir: Path
    output_dir: Path
    run: object  # RunSpec
    spec_json: dict
    resumed_step: int | None
    run_ids: dict[str, str] = field(default_factory=dict)

    def ids(self) -> dict:
        """The tracker run ids a resumed run continues: the checkpoint's (a pod's run directory does not
        outlive the pod), else those <run>/tracking.json keeps (a checkpoint written before a tracker opened)."""
        try:
            kept = json.loads((self.run_dir / "tracking.json").read_text())
        except (OSError, ValueError):
            kept = {}
        return {**(kept if isinstance(kept, dict) else {}), **self.run_ids}

    def save_id(self, tracker: str, run_id: str) -> None:
        self.run_ids[tracker] = run_id
        path = self.run_dir / "tracking.json"
        path.write_text(json.dumps(self.ids(), indent=2) + "\n")  # RUN_IDS (updated above) win in ids()


class Tracker(Protocol):
    """One tracker's library, spoken from the trackers' thread only. NEEDS_HISTORY: its run started empty
    (a new run, or a resume into a new tracker run), so the rows recorded before it opened are sent to it."""

    needs_history: bool

    def log_metrics(self, step: int, metrics: dict[str, float], timestamp: float) -> None: ...
    def log_samples(self, step: int, table: str, samples: list[dict]) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def close(self, status: str) -> None: ...


def check_installed(report_to: list[str]) -> None:
    """OrbitError naming run.report_to when a tracker's library is missing (before the run starts, not hours in)."""
    for name in report_to:
        module, extra = EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            raise OrbitError(f"run.report_to names {name}, but the {module!r} package is not installed: "
                             f"pip install 'orbit[{extra}]' (or remove {name} from run.report_to)")  # fmt: skip


def _opener(name: str) -> Callable[[TrackingContext], Tracker]:
    if name == "tensorboard":
        from orbit_runtime.tracking.tensorboard_tracker import TensorBoardTracker as cls
    elif name == "mlflow":
        from orbit_runtime.tracking.mlflow_tracker import MlflowTracker as cls
    else:
        from orbit_runtime.tracking.wandb_tracker import WandbTracker as cls
    return cls


class TrackerFanout:
    """The trackers of run.report_to behind a queue and a thread (see the module docstring). With no
    trackers every method returns at once and no thread is started."""

    def __init__(self, openers: dict[str, Callable[[], Tracker]], history: list[dict] | None = None) -> None:
        self.names = list(openers)
        self.trackers: dict[str, Tracker] = {}
        self.failures: dict[str, int] = {}
        self._queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        if openers:
            self._thread = threading.Thread(target=self._work, args=(openers, history or []), name="trackers", daemon=True)
            self._thread.start()

    # ---- the training thread's side ----------------------------------------------------------
    def log_row(self, row: dict) -> None:
        """A metrics.jsonl row, as its scalars (see rows.row_metrics); an evaluation's samples as a table."""
        if self._thread is None:
            return
        metrics = row_metrics(row)
        if metrics is not None:
            self._put("metrics", metrics[0], metrics[1], row.get("time", time.time()))
        if row.get("kind") == "eval" and row.get("samples"):
            self._put("samples", row["step"], "eval_samples", [{"step": row["step"], **s} for s in row["samples"]])

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """A step's rollout samples (samples.jsonl's rows) as a table."""
        if self._thread is not None and samples:
            self._put("samples", step, "samples", samples)

    def finish(self, status: str, artifacts: list[Path], timeout_s: float) -> str | None:
        """Log ARTIFACTS (files or directories), close every tracker with STATUS (succeeded, stopped,
        failed), and wait at most TIMEOUT_S in all (queueing included: a full queue is waited on, not
        dropped); returns a warning when the trackers did not finish in time."""
        if self._thread is None:
            return None
        deadline = time.monotonic() + timeout_s
        for path in artifacts:
            self._put("artifact", path, deadline=deadline)
        self._put("close", status, deadline=deadline)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            return f"the trackers ({', '.join(self.names)}) did not finish within {timeout_s:.0f}s; what they had not sent is lost"
        return None

    def _put(self, *item, deadline: float | None = None) -> None:
        """Queue ITEM: at once (dropped and counted when the queue is full), or waiting until DEADLINE."""
        try:
            if deadline is None:
                self._queue.put_nowait(item)
            else:
                self._queue.put(item, timeout=max(0.001, deadline - time.monotonic()))
        except queue.Full:
            TRACKER_DROPPED.inc()

    # ---- the trackers' thread -------------------------------------------------------------------
    def _work(self, openers: dict[str, Callable[[], Tracker]], history: list[dict]) -> None:
        for name, opener in openers.items():
            tracker = self._call(name, "open", opener)
            if tracker is not None:
                self.trackers[name] = tracker
        for row in history:  # the rows recorded before the trackers opened, for tracker runs that start empty
            metrics = row_metrics(row)
            if metrics is not None:
                for name, tracker in self.trackers.items():
                    if tracker.needs_history:
                        self._call(name, "metrics", tracker.log_metrics, metrics[0], metrics[1], row.get("time", 0.0))
        while True:
            operation, *args = self._queue.get()
            for name, tracker in self.trackers.items():
                method = {"metrics": tracker.log_metrics, "samples": tracker.log_samples,
                          "artifact": tracker.log_artifact, "close": tracker.close}[operation]  # fmt: skip
                self._call(name, operation, method, *args)
            if operation == "close":
                return

    def _call(self, name: str, operation: str, method: Callable, *args):
        started = time.monotonic()
        try:
            return method(*args)
        except Exception as exc:  # a tracker's failure is never the run's
            TRACKER_ERRORS.labels(name, operation).inc()
            count = self.failures[name] = self.failures.get(name, 0) + 1
            if count <= WARNINGS_PER_TRACKER or count % 100 == 0:
                log.warning("tracker %s: %s failed (%d failures so far; training goes on): %s: %s",
                            name, operation, count, type(exc).__name__, exc)  # fmt: skip
            return None
        finally:
            TRACKER_SECONDS.labels(name).observe(time.monotonic() - started)


def open_trackers(context: TrackingContext, history: list[dict]) -> TrackerFanout:
    """The fan-out over the trackers context.run.report_to names (checked installed: OrbitError if not).
    HISTORY: the rows recorded before the trackers opened (a resumed run's restored curves), logged to
    tracker runs that start without them."""
    names = list(context.run.report_to)
    check_installed(names)
    for name in names:
        TRACKER_ERRORS.labels(name, "metrics")  # the series exist (at 0) from the start
    return TrackerFanout({name: functools.partial(_opener(name), context) for name in names}, history)
