"""What the operator sees of one RLTrainingJob, typed: the objects it owns (by the controller
ownerReference's UID, as the Job controller's ControllerRef rule: a label or a name never makes
an object ours), the ones that only look like ours, the applied spec, the lifecycle fields as
written, the attempt and failure counts rebuilt from the owned pods, and the learner's parsed
`/status`. Pure: `observe(Observed)` reads the raw objects the handlers fetched."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_operator.learner_report import LearnerReport, parse_learner_report
from orbit_operator.pod import applied_spec
from orbit_operator.pod_health import attempt_of, controlled_by, disrupted, terminating
from orbit_operator.status import prepare_base_report

LIFECYCLE_FIELDS = ("suspend", "restartId", "backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished")


@dataclass
class Observed:
    """What the handlers read for one reconcile (raw API objects)."""

    job: dict  # the RLTrainingJob as read (metadata, spec, status)
    pods: list[dict]  # the pods labelled with this job's name: ours or not is decided here
    configmap: dict | None  # the ConfigMap of the job's name: ours or not is decided here
    now: datetime  # naive UTC
    learner_status: Any = None  # the running learner's /status JSON (untrusted), if it answered
    workload: dict | None = None  # the job's Kueue Workload (by its name, with Kueue enabled): ours or not is decided here


@dataclass(frozen=True)
class Lifecycle:
    suspend: bool
    restartId: str
    backoffLimit: int
    activeDeadlineSeconds: int | None
    ttlSecondsAfterFinished: int | None


def _adapter(name: str) -> TypeAdapter:
    info = RLTrainingJobSpec.model_fields[name]
    return TypeAdapter(Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation)


_LIFECYCLE_ADAPTERS = {name: _adapter(name) for name in LIFECYCLE_FIELDS}


def lifecycle_of(raw_spec: Any, fallback: RLTrainingJobSpec | None) -> Lifecycle:
    """The lifecycle fields as written, each validated on its own: a typo elsewhere in the spec
    never stops suspend, retries, the deadline or the TTL. A field left out takes its default (a
    removed deadline is gone); one that does not validate keeps the applied spec's value (or the
    default); the Invalid condition names it."""
    values = {}
    for name in LIFECYCLE_FIELDS:
        default = RLTrainingJobSpec.model_fields[name].get_default()
        if not isinstance(raw_spec, dict) or name not in raw_spec:
            values[name] = getattr(fallback, name) if fallback is not None and not isinstance(raw_spec, dict) else default
            continue
        try:
            values[name] = _LIFECYCLE_ADAPTERS[name].validate_python(raw_spec[name])
        except ValidationError:
            values[name] = getattr(fallback, name) if fallback is not None else default
    return Lifecycle(**values)


def _count(value: Any) -> int:
    """A non-negative count from the status (which anyone with status access can edit)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass
class JobView:
    name: str
    namespace: str
    uid: str
    generation: int | None
    raw_spec: Any
    status: dict
    owned: list[dict]  # pods whose controller is this job
    foreign: list[str]  # pods with the job's label or name that are not (a deleted job's, an orphan)
    configmap: dict | None  # ours, or None
    foreign_configmap: bool  # a ConfigMap of our name that is not ours (wait until garbage collection removes it)
    applied: RLTrainingJobSpec | None  # the spec our pods are built from (from our ConfigMap)
    lifecycle: Lifecycle
    attempt: int  # the current attempt: the status's, or the highest owned pod's if the status lost it
    failures: int  # pod failures counted against backoffLimit, before the current attempt
    report: LearnerReport | None = None
    report_error: str | None = None  # why (part of) the learner's /status was ignored
    active: list[str] = field(default_factory=list)  # owned pods not finished nor terminating
    workload: dict | None = None  # our Kueue Workload (kueue.py), or None
    queue: str | None = None  # the Kueue queue, when Kueue manages the job (set by reconcile.plan, which knows the settings)

    def pod(self, name: str) -> dict | None:
        return next((p for p in self.owned if p["metadata"]["name"] == name), None)

    @property
    def current_is_active(self) -> bool:
        """Is the current attempt's pod still running (deleting it bumps the attempt; an older one's
        deletion was recorded already, so retrying that DELETE bumps nothing)?"""
        return any((attempt_of(p) or 0) >= self.attempt for p in self.owned if p["metadata"]["name"] in self.active)

    @property
    def owned_terminating(self) -> list[str]:
        return [p["metadata"]["name"] for p in self.owned if terminating(p)]


def counts_as_failure(pod: dict) -> bool:
    """A failed pod that uses up backoffLimit: not disrupted, not refused for not fitting, not one the
    operator itself was deleting (suspend, restart)."""
    if (pod.get("status") or {}).get("phase") != "Failed" or terminating(pod) or disrupted(pod):
        return False
    return (prepare_base_report(pod) or {}).get("reason") != "DoesNotFit"


def observe(observed: Observed) -> JobView:
    job = observed.job
    meta = job.get("metadata") or {}
    uid = meta.get("uid", "")
    owned = [p for p in observed.pods if controlled_by(p, uid)]
    foreign = [p["metadata"]["name"] for p in observed.pods if not controlled_by(p, uid)]
    ours = observed.configmap if controlled_by(observed.configmap, uid) else None
    applied = applied_spec(ours)
    status = dict(job.get("status") or {})
    attempt = max([_count(status.get("attempt")), *(a for p in owned if (a := attempt_of(p)) is not None)])
    derived = sum(1 for p in owned if counts_as_failure(p) and (attempt_of(p) or 0) < attempt)
    report, error = parse_learner_report(observed.learner_status)
    return JobView(
        name=meta.get("name", ""), namespace=meta.get("namespace", "default"), uid=uid, generation=meta.get("generation"),
        raw_spec=job.get("spec"), status=status, owned=owned, foreign=foreign, configmap=ours,
        foreign_configmap=observed.configmap is not None and ours is None, applied=applied,
        lifecycle=lifecycle_of(job.get("spec"), applied), attempt=attempt, failures=max(_count(status.get("failures")), derived),
        report=report, report_error=error, workload=observed.workload if controlled_by(observed.workload, uid) else None,
        active=[p["metadata"]["name"] for p in owned if not terminating(p)
                and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")],
    )  # fmt: skip
