"""The learner's `/status` document (orbit_runtime.trainer.recorder.status_document) as the
operator reads it: untrusted input from a pod, so it is parsed by a pydantic model, never
trusted with `int()`. A field that does not parse is dropped on its own (the job keeps its
last value), a document that is not a JSON object is ignored whole; either is reported once.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # a newer learner may report more; NaN is not JSON


class Checkpoint(_Lenient):
    uri: str | None = None
    step: int | None = Field(None, ge=0)


class OnPolicyHealth(_Lenient):
    """The learner's on-policy guard (orbit_runtime.trainer.on_policy.OnPolicyGuard.health)."""

    state: str | None = None  # off, calibrating, ok, exceeded
    bound: float | None = None
    lastMismatch: float | None = None
    consecutiveSteps: int | None = None
    allowedSteps: int | None = None


class Signal(_Lenient):
    onPolicy: OnPolicyHealth | None = None


class LearnerReport(_Lenient):
    phase: str | None = None  # starting, running, succeeded, stopped, failed
    reason: str | None = None  # why a failed run stopped, e.g. OffPolicy
    step: int | None = Field(None, ge=0)
    maxSteps: int | None = Field(None, ge=0)
    reward: float | None = None
    heldoutAccuracy: float | None = None
    heldoutStderr: float | None = None
    heldoutPrompts: int | None = None
    adapterVersion: int | None = Field(None, ge=0)
    lastCheckpoint: Checkpoint | None = None
    restarts: dict[str, int] | None = None
    signal: Signal | None = None

    def progress(self, previous: dict | None = None) -> dict:
        """`status.progress` (what `kubectl get rljob` and dashboards show): the fields reported, over
        PREVIOUS's for those that were not (a field that did not parse never sets progress back)."""
        progress: dict[str, Any] = dict(previous or {})
        for key, value in (("step", self.step), ("maxSteps", self.maxSteps), ("adapterVersion", self.adapterVersion),
                           ("learnerPhase", self.phase), ("reward", self.reward), ("heldoutAccuracy", self.heldoutAccuracy),
                           ("heldoutStderr", self.heldoutStderr), ("heldoutPrompts", self.heldoutPrompts)):  # fmt: skip
            if value is not None:
                progress[key] = value
        progress.setdefault("step", 0)
        progress.setdefault("maxSteps", 0)
        progress["stepText"] = f"{progress['step']}/{progress['maxSteps']}"
        if self.lastCheckpoint is not None:
            progress["lastCheckpoint"] = {"uri": self.lastCheckpoint.uri or "", "step": self.lastCheckpoint.step or 0}
        if self.restarts is not None:
            progress["roleRestarts"] = dict(self.restarts)
        return progress

    @property
    def on_policy(self) -> OnPolicyHealth | None:
        return self.signal.onPolicy if self.signal is not None else None


def parse_learner_report(document: Any) -> tuple[LearnerReport | None, str | None]:
    """(the report, None), or (what parsed, why the rest was ignored): the top-level fields that do
    not validate are dropped (named in the reason); a document that is not a JSON object is ignored whole."""
    if document is None:
        return None, None
    if not isinstance(document, dict):
        return None, f"the learner's /status is a {type(document).__name__}, not a JSON object"
    dropped: list[str] = []
    for _ in range(len(document) + 1):
        try:
            report = LearnerReport.model_validate(document)
        except ValidationError as exc:
            bad = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
            dropped += sorted(key for key in bad if key in document)
            document = {k: v for k, v in document.items() if k not in bad}
            continue
        # the field names only: the same fields failing with other values are reported once
        return report, (f"ignored fields of the learner's /status that do not parse: {', '.join(dropped)}" if dropped else None)
    return None, "the learner's /status does not parse"
