"""What to do for one RLTrainingJob, decided from what is observed. Pure: no API calls.

`plan(observed, settings)` looks at the job (spec, status, generation), its pods and its
ConfigMap, the learner's last `/status`, and the time, and returns a `Plan`: objects to
create or delete, the status to write, the events to post, and when to look again. The
handlers (handlers.py) observe, call `plan`, and carry it out; running the same plan twice
is harmless, because every object has a deterministic name and every decision is read off
the status the previous run wrote.

Lifecycle:
- invalid spec -> Failed with an `Invalid` condition naming the fields (nothing created);
- suspend: true -> the pod is deleted, status kept, phase Suspended; false -> a new pod
  (the learner resumes from the last checkpoint);
- a pod fails -> `failures` + 1; within backoffLimit a new pod (attempt + 1) after an
  exponential backoff, else Failed (BackoffLimitExceeded);
- a changed `restartId` -> a new pod (not counted as a failure);
- activeDeadlineSeconds passed -> pod deleted, Failed (DeadlineExceeded);
- finished + ttlSecondsAfterFinished passed -> the job is deleted;
- a spec change the running pod cannot take (anything but the lifecycle fields) is refused:
  a `SpecChangeRefused` condition names the fields, the pod keeps running the old spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

import yaml

from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_operator.pod import CONFIG_FILE, build_configmap, build_pod, object_names
from orbit_operator.settings import OperatorSettings
from orbit_operator.status import TERMINAL, backoff_seconds, phase_of_pod, progress_from_learner, set_condition
from orbit_operator.validation import validate_job
from orbit_runtime.config.fingerprint import describe_differences

LIFECYCLE_FIELDS = ("suspend", "restartId", "backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished")
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def _time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.strptime(value, TIME_FORMAT)
    except ValueError:
        return None


@dataclass
class Observed:
    job: dict  # the RLTrainingJob as read (metadata, spec, status)
    pods: list[dict]  # the pods labelled with this job
    configmap: dict | None
    now: datetime  # naive UTC
    learner_status: dict | None = None  # the running learner's /status, if it answered


@dataclass
class Plan:
    status: dict  # the whole new status
    create_configmap: dict | None = None
    create_pod: dict | None = None
    delete_pods: list[str] = field(default_factory=list)
    delete_job: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (Normal|Warning, reason, message)
    requeue_after: float | None = None


def _flat(data: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(_flat(value, name))
        else:
            out[name] = value
    return out


def refused_changes(configmap: dict | None, desired: dict) -> list[str]:
    """Fields whose value differs between the ConfigMap the pod runs and what the spec now asks for."""
    if configmap is None:
        return []
    try:
        running = yaml.safe_load(configmap.get("data", {}).get(CONFIG_FILE, "")) or {}
        wanted = yaml.safe_load(desired["data"][CONFIG_FILE])
    except yaml.YAMLError:
        return ["(the ConfigMap is unreadable)"]
    return describe_differences(_flat(running), _flat(wanted), labels=("running", "spec"))


def plan(observed: Observed, settings: OperatorSettings) -> Plan:  # noqa: C901 - one decision table, read top to bottom
    job, now = observed.job, observed.now
    meta, status = job.get("metadata", {}), dict(job.get("status") or {})
    name, namespace = meta.get("name", ""), meta.get("namespace", "default")
    stamp = now.strftime(TIME_FORMAT)
    status["observedGeneration"] = meta.get("generation")
    conditions = list(status.get("conditions") or [])
    old_phase = status.get("phase")
    events: list[tuple[str, str, str]] = []

    def finish(phase: str, **extra) -> Plan:
        status.update(phase=phase, conditions=conditions, **{k: v for k, v in extra.items() if k != "plan"})
        result = extra.get("plan") or Plan(status)
        result.status = status
        if phase != old_phase:
            events.append(("Warning" if phase == "Failed" else "Normal", phase, f"{old_phase or 'New'} -> {phase}"))
        result.events = events + result.events
        return result

    check = validate_job(job, f"RLTrainingJob {namespace}/{name}", settings.max_gpus_per_node)
    if not check.ok:
        message = "; ".join(check.errors)[:1000]
        conditions = set_condition(conditions, "Invalid", True, "InvalidSpec", message, stamp)
        conditions = set_condition(conditions, "Ready", False, "InvalidSpec", "the spec is invalid", stamp)
        events.append(("Warning", "Invalid", message))
        return finish("Failed", plan=Plan(status, delete_pods=_active(observed.pods)))
    was_invalid = any(c.get("type") == "Invalid" for c in conditions)
    conditions = [c for c in conditions if c.get("type") != "Invalid"]
    spec: RLTrainingJobSpec = check.spec  # type: ignore[assignment]
    if was_invalid and old_phase == "Failed":  # the spec was fixed: the job starts now
        old_phase = None
        events.append(("Normal", "SpecFixed", "the spec is valid now"))

    if old_phase in TERMINAL:
        ttl, finished = spec.ttlSecondsAfterFinished, _time(status.get("completionTime"))
        if ttl is not None and finished is not None:
            due = finished + timedelta(seconds=ttl)
            if now >= due:
                return finish(old_phase, plan=Plan(status, delete_job=True))
            return finish(old_phase, plan=Plan(status, requeue_after=(due - now).total_seconds()))
        return finish(old_phase)

    attempt, failures = int(status.get("attempt", 0)), int(status.get("failures", 0))
    desired_configmap = build_configmap(name, namespace, spec, settings)
    pod_name = object_names(name, attempt)["pod"]
    pod = next((p for p in observed.pods if p["metadata"]["name"] == pod_name), None)
    active = _active(observed.pods)

    if spec.suspend:
        conditions = set_condition(conditions, "Suspended", True, "Suspended", "spec.suspend is true", stamp)
        if active:  # the next pod gets a new name: never confused with the one still terminating
            status["attempt"] = attempt + 1
        return finish("Suspended", plan=Plan(status, delete_pods=active))
    conditions = [c for c in conditions if c.get("type") != "Suspended"]
    started = _time(status.get("startTime"))
    if spec.activeDeadlineSeconds is not None and started is not None:
        if now >= started + timedelta(seconds=spec.activeDeadlineSeconds):
            conditions = set_condition(conditions, "Failed", True, "DeadlineExceeded",
                                       f"ran longer than activeDeadlineSeconds ({spec.activeDeadlineSeconds})", stamp)  # fmt: skip
            return finish("Failed", completionTime=stamp, plan=Plan(status, delete_pods=active))

    changes = refused_changes(observed.configmap, desired_configmap) if active else []
    if changes:
        conditions = set_condition(conditions, "SpecChangeRefused", True, "ImmutableWhileRunning",
                                   "cannot change while the pod runs (suspend the job first): " + "; ".join(changes)[:900], stamp)  # fmt: skip
        if not any(c.get("type") == "SpecChangeRefused" and c.get("status") == "True" for c in status.get("conditions") or []):
            events.append(("Warning", "SpecChangeRefused", "; ".join(changes)[:900]))
    else:
        conditions = [c for c in conditions if c.get("type") != "SpecChangeRefused"]

    if pod is not None and status.get("restartId", "") != spec.restartId and pod_name in active:
        events.append(("Normal", "Restarting", f"restartId changed to {spec.restartId!r}: new pod"))
        status.update(attempt=attempt + 1, restartId=spec.restartId)
        return finish(old_phase or "Pending", plan=Plan(status, delete_pods=active, requeue_after=1.0))
    status["restartId"] = spec.restartId

    if pod is None:
        retry_at = _time(status.get("nextAttemptAt"))
        if retry_at is not None and now < retry_at:
            return finish(old_phase or "Pending", plan=Plan(status, requeue_after=(retry_at - now).total_seconds()))
        new_pod = build_pod(name, namespace, spec, settings, attempt)
        status.update(podName=pod_name, startTime=status.get("startTime") or stamp)
        status.pop("nextAttemptAt", None)
        conditions = set_condition(conditions, "Ready", False, "PodCreated", f"pod {pod_name} created", stamp)
        events.append(("Normal", "PodCreated", f"created pod {pod_name} (attempt {attempt})"))
        # no pod runs: the ConfigMap may be (re)written with the current spec
        return finish("Pending", plan=Plan(status, create_configmap=desired_configmap, create_pod=new_pod, requeue_after=2.0))

    pod_phase = phase_of_pod(pod)
    if observed.learner_status is not None:
        status["progress"] = progress_from_learner(observed.learner_status)
    if pod_phase == "Succeeded":
        conditions = set_condition(conditions, "Complete", True, "LearnerSucceeded", f"pod {pod_name} finished", stamp)
        conditions = set_condition(conditions, "Ready", False, "Finished", "the job finished", stamp)
        return finish("Succeeded", completionTime=stamp, plan=Plan(status, requeue_after=_ttl_wait(spec)))
    if pod_phase == "Failed":
        failures += 1
        reason = _failure_reason(pod)
        if failures > spec.backoffLimit:
            conditions = set_condition(conditions, "Failed", True, "BackoffLimitExceeded",
                                       f"{failures} pod failures, backoffLimit {spec.backoffLimit}; last: {reason}", stamp)  # fmt: skip
            return finish("Failed", failures=failures, completionTime=stamp, plan=Plan(status, requeue_after=_ttl_wait(spec)))
        delay = backoff_seconds(failures, base=settings.backoff_base_seconds)
        retry_at = now + timedelta(seconds=delay)
        events.append(("Warning", "PodFailed", f"pod {pod_name} failed ({reason}); new pod in {delay:.0f}s "
                                               f"({failures}/{spec.backoffLimit} failures)"))  # fmt: skip
        conditions = set_condition(conditions, "Ready", False, "PodFailed", reason, stamp)
        status.update(failures=failures, attempt=attempt + 1, nextAttemptAt=retry_at.strftime(TIME_FORMAT))
        return finish("Pending", plan=Plan(status, requeue_after=delay))
    ready = pod_phase == "Running"
    conditions = set_condition(conditions, "Ready", ready, "PodRunning" if ready else "PodStarting",
                               f"pod {pod_name} is {pod_phase.lower()}", stamp)  # fmt: skip
    return finish(pod_phase, attempt=attempt, failures=failures, plan=Plan(status, requeue_after=settings.status_poll_seconds))


def _active(pods: list[dict]) -> list[str]:
    """Names of pods that have not finished (to delete on suspend, deadline, restart)."""
    return [p["metadata"]["name"] for p in pods if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def _ttl_wait(spec: RLTrainingJobSpec) -> float | None:
    return float(spec.ttlSecondsAfterFinished) if spec.ttlSecondsAfterFinished is not None else None


def _failure_reason(pod: dict) -> str:
    """The first terminated container's reason and exit code, e.g. 'learner: Error (exit 1)'."""
    status = pod.get("status") or {}
    for container in [*(status.get("containerStatuses") or []), *(status.get("initContainerStatuses") or [])]:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode", 0) != 0:
            return f"{container.get('name')}: {terminated.get('reason', 'Error')} (exit {terminated.get('exitCode')})"
    return status.get("reason") or status.get("message") or "pod failed"
