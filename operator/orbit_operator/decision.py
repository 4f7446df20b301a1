"""What one reconcile decides, as it is built: the `Plan` (objects to create or delete, the status
to write, the events to post) and `Decision`, the status being written with its conditions
(each stamped with the generation it was decided at) and events, and the phase transition
announced once."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from orbit_operator.observe import JobView
from orbit_operator.status import TERMINAL, set_condition

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.strptime(value, TIME_FORMAT)
    except ValueError:
        return None


@dataclass
class Plan:
    status: dict  # the whole new status
    create_configmap: dict | None = None
    create_pod: dict | None = None
    delete_pods: list[str] = field(default_factory=list)
    delete_job: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (Normal|Warning, reason, message)
    requeue_after: float | None = None
    rejection: str = ""  # set by the handlers: why the API server refused create_pod for good
    create_workload: dict | None = None  # the job's Kueue Workload (kueue.py)
    workload_patch: dict | None = None  # a merge patch of the Workload's status (Finished, or its admission released)
    workload_active: bool | None = None  # set the Workload's spec.active (False while the job is suspended)
    workload_queue: str | None = None  # set the Workload's spec.queueName (the job's label changed, no quota reserved)
    delete_workload: bool = False  # delete the Workload first (other pod requests, or the queue label removed)


class Decision:
    """The status being written, its conditions and the events to post, for one plan()."""

    def __init__(self, view: JobView, now: datetime) -> None:
        self.view, self.now, self.stamp = view, now, now.strftime(TIME_FORMAT)
        self.status = dict(view.status)
        self.conditions = list(self.status.get("conditions") or [])
        self.old = {c.get("type"): c for c in self.conditions}
        self.recorded_phase = self.status.get("phase")  # transitions are announced against it
        self.events: list[tuple[str, str, str]] = []
        self.applied = True  # False: this generation was refused (invalid, or a change the run cannot take)

    def condition(self, type_: str, value: bool | None, reason: str, message: str) -> None:
        self.conditions = set_condition(self.conditions, type_, value, reason, message, self.stamp, self.view.generation)

    def drop(self, type_: str) -> None:
        self.conditions = [c for c in self.conditions if c.get("type") != type_]

    def is_true(self, type_: str) -> bool:
        return (self.old.get(type_) or {}).get("status") == "True"

    def newly(self, type_: str, message: str) -> bool:
        """Is condition TYPE being set True with this message for the first time (post its event once)?"""
        old = self.old.get(type_)
        return not (old and old.get("status") == "True" and old.get("message") == message)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def finish(self, phase: str, result: Plan | None = None, **extra) -> Plan:
        """The plan, with the status's phase and conditions; a terminal one is also due at its TTL."""
        self.status.update(phase=phase, conditions=self.conditions, **extra)
        if self.applied:
            self.status["observedGeneration"] = self.view.generation
        result = result or Plan(self.status)
        result.status = self.status
        if phase in TERMINAL:
            ttl = ttl_plan(self.status, self.view.lifecycle.ttlSecondsAfterFinished, self.now)
            result.delete_job = result.delete_job or ttl.delete_job
            result.requeue_after = ttl.requeue_after if result.requeue_after is None else result.requeue_after
        if phase != self.recorded_phase:
            self.event("Warning" if phase == "Failed" else "Normal", phase, f"{self.recorded_phase or 'New'} -> {phase}")
        result.events = self.events + result.events
        return result


def ttl_plan(status: dict, ttl: int | None, now: datetime) -> Plan:
    """A finished job: deleted once its TTL passed, else looked at again then."""
    finished = parse_time(status.get("completionTime"))
    if ttl is None or finished is None:
        return Plan(status)
    due = finished + timedelta(seconds=ttl)
    return Plan(status, delete_job=True) if now >= due else Plan(status, requeue_after=(due - now).total_seconds())
