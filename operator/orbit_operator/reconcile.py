"""What to do for one RLTrainingJob, decided from what is observed. Pure: no API calls.

`plan(observed, settings)` looks at the job (spec, status, generation), its pods and its
ConfigMap, the learner's last `/status`, and the time, and returns a `Plan`: objects to
create or delete, the status to write, the events to post. The handlers (handlers.py)
observe, call `plan`, and carry it out; running the same plan twice is harmless, because
every object has a deterministic name and every decision is read off the status the
previous run wrote.

The applied spec: the ConfigMap records the spec the job's pods are built from. It is
replaced by the current spec only when the job (re)starts: the first pod, a resume after
`suspend`, a new `restartId`. A pod that replaces a failed one is built from the applied
spec, so a change the running job could not take never slips in through a failure.

Lifecycle:
- invalid spec, no pod -> Failed with an `Invalid` condition naming the fields; while a
  pod runs, the pod is kept (a typo never kills a run) and only `Invalid` is set;
- suspend: true -> the pod is deleted, status kept, phase Suspended; false -> a new pod (the
  learner resumes from the last checkpoint) and the deadline clock restarts, as for Jobs;
- a pod fails -> `failures` + 1; within backoffLimit a new pod (attempt + 1) after an
  exponential backoff, else Failed (BackoffLimitExceeded);
- a changed `restartId` -> a new pod with the current spec (not counted as a failure);
- activeDeadlineSeconds passed -> pod deleted, Failed (DeadlineExceeded);
- finished (or Failed as invalid) + ttlSecondsAfterFinished passed -> the job is deleted;
- a spec change other than the lifecycle fields while the job runs is refused: a
  `SpecChangeRefused` condition names the fields (apply it with a new restartId, or by
  suspending and resuming);
- no new pod while an old one of the job is still terminating (two learners never write
  the same checkpoints);
- does it fit its node? Before the job ever starts, when it names its architecture
  (base.architecture / base.modelConfig) the operator plans it (orbit_operator.fit): a job
  that cannot fit is Failed with reason DoesNotFit and the breakdown, no pod created; one
  that fits records the plan's summary in status.plan. The first pod's prepare-base plans
  again with the base's own config.json and fails the pod with DoesNotFit, which fails the
  job the same way (no retry: another pod would not fit either). Either way the job never
  ran, and an edit that makes it fit starts it. Later pods (retries, resumes) never enforce
  the plan: a running job is never refused by a stricter planner.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from orbit_operator.fit import admission_fit
from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_operator.pod import applied_spec, build_configmap, build_pod, object_names
from orbit_operator.settings import OperatorSettings
from orbit_operator.status import (
    TERMINAL,
    backoff_seconds,
    phase_of_pod,
    prepare_base_report,
    progress_from_learner,
    set_condition,
)
from orbit_operator.validation import validate_job
from orbit_runtime.config.fingerprint import describe_differences
from orbit_runtime.errors import OrbitError

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


PLANNER_ONLY_FIELDS = ("base.architecture", "base.modelConfig")  # read by the admission plan only: the pod never changes


def _spec_fields(spec: RLTrainingJobSpec) -> dict:
    fields = _flat({k: v for k, v in spec.model_dump(mode="json").items() if k not in LIFECYCLE_FIELDS})
    return {k: v for k, v in fields.items() if not k.startswith(PLANNER_ONLY_FIELDS)}


def refused_changes(applied: RLTrainingJobSpec | None, spec: RLTrainingJobSpec) -> list[str]:
    """Fields (other than the lifecycle ones) whose value differs between the applied spec and the current one."""
    if applied is None:
        return []
    return describe_differences(_spec_fields(applied), _spec_fields(spec), labels=("running", "spec"))


def _pending_reason(pod: dict) -> str:
    """Why a pod has not started: a container waiting reason (ImagePullBackOff, CreateContainerConfigError, ...)
    or the scheduler's message; empty if it is just starting."""
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            return f"{container.get('name')}: {waiting['reason']}" + (f" ({waiting['message']})" if waiting.get("message") else "")
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f"unschedulable: {condition.get('message') or condition.get('reason', '')}"
    return ""


def _raw_ttl(job: dict) -> int | None:
    value = (job.get("spec") or {}).get("ttlSecondsAfterFinished") if isinstance(job.get("spec"), dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _ttl_plan(status: dict, ttl: int | None, now: datetime) -> Plan:
    """A finished job: deleted once its TTL passed, else looked at again then."""
    finished = _time(status.get("completionTime"))
    if ttl is None or finished is None:
        return Plan(status)
    due = finished + timedelta(seconds=ttl)
    return Plan(status, delete_job=True) if now >= due else Plan(status, requeue_after=(due - now).total_seconds())


def plan(observed: Observed, settings: OperatorSettings) -> Plan:  # noqa: C901 - one decision table, read top to bottom
    job, now = observed.job, observed.now
    meta, status = job.get("metadata", {}), copy.deepcopy(dict(job.get("status") or {}))
    name, namespace = meta.get("name", ""), meta.get("namespace", "default")
    stamp = now.strftime(TIME_FORMAT)
    status["observedGeneration"] = meta.get("generation")
    conditions = list(status.get("conditions") or [])
    old_conditions = {c.get("type"): c for c in conditions}
    old_phase = status.get("phase")
    events: list[tuple[str, str, str]] = []
    active = _active(observed.pods)

    recorded_phase = old_phase  # what the status said: transitions are announced against it

    def finish(phase: str, result: Plan | None = None, **extra) -> Plan:
        status.update(phase=phase, conditions=conditions, **extra)
        result = result or Plan(status)
        result.status = status
        if phase != recorded_phase:
            events.append(("Warning" if phase == "Failed" else "Normal", phase, f"{recorded_phase or 'New'} -> {phase}"))
        result.events = events + result.events
        return result

    def newly(type_: str, message: str) -> bool:
        """Is condition TYPE being set True with this message for the first time (post its event once)?"""
        old = old_conditions.get(type_)
        return not (old and old.get("status") == "True" and old.get("message") == message)

    check = validate_job(job, f"RLTrainingJob {namespace}/{name}", settings.max_gpus_per_node, settings.allow_image_override)
    if not check.ok:
        message = "; ".join(check.errors)[:1000]
        if newly("Invalid", message):
            events.append(("Warning", "Invalid", message))
        conditions = set_condition(conditions, "Invalid", True, "InvalidSpec", message, stamp)
        if active:  # keep the run: only a fresh start needs a valid spec
            return finish(old_phase or "Running")
        conditions = set_condition(conditions, "Ready", False, "InvalidSpec", "the spec is invalid", stamp)
        status.setdefault("completionTime", stamp)
        return finish("Failed", _ttl_plan(status, _raw_ttl(job), now))
    was_invalid_failure = old_phase == "Failed" and old_conditions.get("Invalid", {}).get("status") == "True"
    conditions = [c for c in conditions if c.get("type") != "Invalid"]
    spec: RLTrainingJobSpec = check.spec  # type: ignore[assignment]
    if was_invalid_failure:  # the spec was fixed: the job starts now
        old_phase = None
        status.pop("completionTime", None)
        status["reapply"] = True
        events.append(("Normal", "SpecFixed", "the spec is valid now"))

    failed = old_conditions.get("Failed") or {}
    edited = (job.get("status") or {}).get("observedGeneration") != meta.get("generation")
    if old_phase == "Failed" and failed.get("reason") == "DoesNotFit" and not status.get("startTime") and edited:
        old_phase = None  # refused before it ever ran, and its spec changed since: planned again
        status.pop("completionTime", None)
        status["reapply"] = True  # its next pod takes the edited spec, not the one the refused pod was built from
        conditions = [c for c in conditions if c.get("type") != "Failed"]
    if old_phase in TERMINAL:
        return finish(old_phase, _ttl_plan(status, spec.ttlSecondsAfterFinished, now))
    if not status.get("startTime") and not active:
        try:
            fit = admission_fit(spec, settings)
        except (OrbitError, ValueError) as exc:  # e.g. a linear the group size cannot split: the planner cannot judge it
            fit, status["plan"] = None, f"not planned: {exc}"[:500]
        if fit is not None and not fit.fits:
            message = fit.message()[:1000]
            if failed.get("reason") != "DoesNotFit" or failed.get("message") != message:
                events.append(("Warning", "DoesNotFit", message))
            conditions = set_condition(conditions, "Failed", True, "DoesNotFit", message, stamp)
            conditions = set_condition(conditions, "Ready", False, "DoesNotFit", "the job cannot fit its node", stamp)
            status.update(plan=fit.summary()[:500], completionTime=stamp)
            return finish("Failed", _ttl_plan(status, spec.ttlSecondsAfterFinished, now))
        if fit is not None:
            status["plan"] = fit.summary()[:500]

    attempt, failures = int(status.get("attempt", 0)), int(status.get("failures", 0))
    pod_name = object_names(name, attempt)["pod"]
    pod = next((p for p in observed.pods if p["metadata"]["name"] == pod_name), None)
    applied = applied_spec(observed.configmap)

    if spec.suspend:
        conditions = set_condition(conditions, "Suspended", True, "Suspended", "spec.suspend is true", stamp)
        if active:  # the next pod gets a new name: never confused with the one still terminating
            status["attempt"] = attempt + 1
        status["reapply"] = True
        return finish("Suspended", Plan(status, delete_pods=active))
    conditions = [c for c in conditions if c.get("type") != "Suspended"]
    started = _time(status.get("startTime"))
    if spec.activeDeadlineSeconds is not None and started is not None and old_phase != "Suspended":
        if now >= started + timedelta(seconds=spec.activeDeadlineSeconds):
            conditions = set_condition(conditions, "Failed", True, "DeadlineExceeded",
                                       f"ran longer than activeDeadlineSeconds ({spec.activeDeadlineSeconds})", stamp)  # fmt: skip
            return finish("Failed", Plan(status, delete_pods=active), completionTime=stamp)

    if status.get("restartId", "") != spec.restartId and "podName" not in status:
        status["restartId"] = spec.restartId  # set from the start: nothing to restart
    if status.get("restartId", "") != spec.restartId:
        events.append(("Normal", "Restarting", f"restartId changed to {spec.restartId!r}: a new pod with the current spec"))
        status.update(restartId=spec.restartId, reapply=True)
        if active:
            status["attempt"] = attempt + 1
            return finish(old_phase or "Pending", Plan(status, delete_pods=active))
    reapply = bool(status.get("reapply")) or applied is None
    changes = [] if reapply else refused_changes(applied, spec)
    if changes:
        message = "cannot change while the job runs (set a new restartId, or suspend and resume): " + "; ".join(changes)
        if newly("SpecChangeRefused", message[:900]):
            events.append(("Warning", "SpecChangeRefused", "; ".join(changes)[:900]))
        conditions = set_condition(conditions, "SpecChangeRefused", True, "ImmutableWhileRunning", message[:900], stamp)
    else:
        conditions = [c for c in conditions if c.get("type") != "SpecChangeRefused"]

    if pod is None:
        if any(p["metadata"].get("deletionTimestamp") for p in observed.pods):
            return finish(old_phase or "Pending", Plan(status, requeue_after=2.0))  # wait until the old pod is gone
        retry_at = _time(status.get("nextAttemptAt"))
        if retry_at is not None and now < retry_at:
            return finish(old_phase or "Pending", Plan(status, requeue_after=(retry_at - now).total_seconds()))
        use = spec if reapply else applied
        first_start = not status.get("startTime")  # only the job's first pod may refuse it for not fitting
        new_pod = build_pod(name, namespace, use, settings, attempt, enforce_fit=first_start)  # type: ignore[arg-type]
        if old_phase == "Suspended" or not status.get("startTime"):
            status["startTime"] = stamp  # the deadline counts from the (re)start
        status.update(podName=pod_name)
        for key in ("nextAttemptAt", "reapply"):
            status.pop(key, None)
        conditions = set_condition(conditions, "Ready", False, "PodCreated", f"pod {pod_name} created", stamp)
        events.append(("Normal", "PodCreated", f"created pod {pod_name} (attempt {attempt})"))
        configmap = build_configmap(name, namespace, use, settings) if reapply else None  # type: ignore[arg-type]
        return finish("Pending", Plan(status, create_configmap=configmap, create_pod=new_pod, requeue_after=2.0))

    pod_phase = phase_of_pod(pod)
    status["podName"] = pod_name  # also for a pod an operator created just before it died (adopted)
    report = prepare_base_report(pod)
    if report and isinstance(report.get("plan"), str):
        status["plan"] = report["plan"][:500]
    status.setdefault("startTime", stamp)
    if observed.learner_status is not None:
        status["progress"] = progress_from_learner(observed.learner_status)
    if pod_phase == "Succeeded":
        conditions = set_condition(conditions, "Complete", True, "LearnerSucceeded", f"pod {pod_name} finished", stamp)
        conditions = set_condition(conditions, "Ready", False, "Finished", "the job finished", stamp)
        return finish("Succeeded", _ttl_plan({**status, "completionTime": stamp}, spec.ttlSecondsAfterFinished, now),
                      completionTime=stamp)  # fmt: skip
    if pod_phase == "Failed" and report and report.get("reason") == "DoesNotFit":
        # only the first pod enforces the plan: the learner never ran, so the job counts as never started
        # (an edit that makes it fit starts it, as after a refusal at admission) and its next pod gets a new name
        message = str(report.get("message", ""))[:1000]
        events.append(("Warning", "DoesNotFit", message))
        conditions = set_condition(conditions, "Failed", True, "DoesNotFit", message, stamp)
        conditions = set_condition(conditions, "Ready", False, "DoesNotFit", "the job cannot fit its node", stamp)
        status.pop("startTime", None)
        return finish("Failed", completionTime=stamp, attempt=attempt + 1)
    if pod_phase == "Failed":
        failures += 1
        reason = _failure_reason(pod)
        if failures > spec.backoffLimit:
            conditions = set_condition(conditions, "Failed", True, "BackoffLimitExceeded",
                                       f"{failures} pod failures, backoffLimit {spec.backoffLimit}; last: {reason}", stamp)  # fmt: skip
            return finish("Failed", failures=failures, completionTime=stamp)
        delay = backoff_seconds(failures, base=settings.backoff_base_seconds)
        retry_at = now + timedelta(seconds=delay)
        events.append(("Warning", "PodFailed", f"pod {pod_name} failed ({reason}); new pod in {delay:.0f}s "
                                               f"({failures}/{spec.backoffLimit} failures)"))  # fmt: skip
        conditions = set_condition(conditions, "Ready", False, "PodFailed", reason, stamp)
        status.update(failures=failures, attempt=attempt + 1, nextAttemptAt=retry_at.strftime(TIME_FORMAT))
        return finish("Pending", Plan(status, requeue_after=delay))
    ready = pod_phase == "Running"
    waiting = "" if ready else _pending_reason(pod)
    conditions = set_condition(conditions, "Ready", ready, "PodRunning" if ready else ("PodWaiting" if waiting else "PodStarting"),
                               waiting or f"pod {pod_name} is {pod_phase.lower()}", stamp)  # fmt: skip
    return finish(pod_phase, Plan(status, requeue_after=settings.status_poll_seconds), attempt=attempt, failures=failures)


def pod_rejected(status: dict, message: str, now: datetime) -> dict:
    """The status after the API server refused the job's pod (403 by Pod Security admission, 422 for a
    malformed toleration, a missing priority class, ...): Failed, with the server's reason."""
    stamp = now.strftime(TIME_FORMAT)
    conditions = set_condition(list(status.get("conditions") or []), "Failed", True, "PodRejected", message[:1000], stamp)
    return {**status, "phase": "Failed", "conditions": conditions, "completionTime": stamp}


def _active(pods: list[dict]) -> list[str]:
    """Names of pods that have not finished (to delete on suspend, deadline, restart)."""
    return [p["metadata"]["name"] for p in pods if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def _failure_reason(pod: dict) -> str:
    """The first terminated container's reason and exit code, e.g. 'learner: Error (exit 1)'."""
    status = pod.get("status") or {}
    for container in [*(status.get("containerStatuses") or []), *(status.get("initContainerStatuses") or [])]:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode", 0) != 0:
            reason = f"{container.get('name')}: {terminated.get('reason', 'Error')} (exit {terminated.get('exitCode')})"
            last_line = next((line for line in reversed((terminated.get("message") or "").splitlines()) if line.strip()), "")
            # an error exit's message is the end of its log (FallbackToLogsOnError): its last line says why;
            # after a signal (exit > 128) the log just stops, so it is not quoted
            quote = last_line and not last_line.startswith("{") and terminated.get("exitCode", 0) < 128
            return f"{reason}: {last_line.strip()[:300]}" if quote else reason
    return status.get("reason") or status.get("message") or "pod failed"
