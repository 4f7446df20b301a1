"""Metrics of the experiment trackers (`orbit_runtime/tracking`), on the learner's registry: calls
that failed (the run went on without them), records dropped because a tracker fell behind, and
how long each call took (a slow tracking server shows here before it shows anywhere else)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from orbit_runtime.observability.metrics import LEARNER_REGISTRY

TRACKER_ERRORS = Counter(
    "orbit_tracker_errors_total", "Tracker calls that raised (training went on), by tracker and operation "
    "(open, metrics, samples, artifact, close).", ["tracker", "operation"], registry=LEARNER_REGISTRY,
)  # fmt: skip
TRACKER_DROPPED = Counter(
    "orbit_tracker_dropped_total", "Records not sent to the trackers because their queue was full (a tracker fell behind).",
    registry=LEARNER_REGISTRY,
)  # fmt: skip
TRACKER_SECONDS = Histogram(
    "orbit_tracker_call_seconds", "Wall time of one tracker call, by tracker (on the trackers' thread, not the step's).",
    ["tracker"], buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120), registry=LEARNER_REGISTRY,
)  # fmt: skip
