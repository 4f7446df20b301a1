"""What to do for one RLTrainingJob, decided from what is observed. Pure: no API calls.

`plan(observed, settings)` reads the job, its pods and ConfigMap, the learner's last
`/status` and the time (observe.py types them: what is *ours* is decided by the controller
ownerReference's UID, never by a label or a name), and returns a `Plan`: objects to create or
delete, the status to write, the events to post. The handlers (handlers.py) write the status
first and act after, so an operator that dies in between finds the decision recorded; running
the same plan twice is harmless, because every object has a deterministic name.

The applied spec: our ConfigMap records the spec our pods are built from. It is replaced by
the current spec only when the job (re)starts: the first pod, a resume after `suspend`, a new
`restartId`. A pod that replaces a failed one is built from the applied spec, so a change the
running job could not take never slips in through a failure, and a bad edit never stops retries.

Lifecycle:
- terminal stays terminal: a Succeeded or Failed job never changes phase or runs again. The
  exception is a job that never ran because its spec was invalid or it did not fit its node:
  an edit that fixes it starts it.
- the spec is validated always (an `Invalid` condition names the fields) but needed only to
  build from it: a never-started job with an invalid spec is Failed; a running one keeps its
  pod and its lifecycle (suspend, retries from the applied spec, the deadline, the TTL: those
  fields are read on their own, observe.lifecycle_of); a resume or restart waits for a fix;
- suspend: true -> the pod is deleted, status kept, phase Suspended; false -> a new pod (the
  learner resumes from the last checkpoint), `Suspended=False` (Resumed);
- a pod fails -> `failures` + 1; within backoffLimit a new pod (attempt + 1) after an
  exponential backoff, else Failed (BackoffLimitExceeded). A pod failed by a disruption
  (preemption, eviction: a `DisruptionTarget` condition) is replaced without counting, as
  Jobs' podFailurePolicy does; a learner that stopped itself for training off-policy fails
  the job (OffPolicy) without a retry that would do the same;
- a changed `restartId` -> a new pod with the current spec (not counted as a failure); on a
  terminal job it is ignored, with a warning event;
- activeDeadlineSeconds counts from when the pod left the queue (scheduled), not while it
  waits for admission; suspend resets it, as for Jobs;
- finished + ttlSecondsAfterFinished passed -> the job is deleted;
- a spec change other than the lifecycle fields while the job runs is refused: a
  `SpecChangeRefused` condition names the fields (apply it with a new restartId, or by
  suspending and resuming); `status.observedGeneration` moves only to generations applied;
- no new pod while an old one of ours is still terminating, or while pods or a ConfigMap of
  the job's name that are not ours (a deleted job of the same name) are still there: two
  learners never write the same checkpoints;
- Ready is the pod's `Ready` condition: a terminating pod (PodTerminating, NodeUnreachable) or
  a crash-looping container is not ready, and a terminating pod's learner is not polled;
- `OnPolicy`: the learner's on-policy guard (its `/status`), with the figures;
- does it fit its node? Before the job ever starts, when it names its architecture the
  operator plans it (orbit_operator.fit): a job that cannot fit is Failed with reason
  DoesNotFit and the breakdown, no pod created. The first pod's prepare-base plans again with
  the base's own config.json and fails the pod with DoesNotFit, which fails the job the same
  way. Later pods (retries, resumes) never enforce the plan.
- attempt and failures are rebuilt from the owned pods (their attempt label) when the status
  lost them (a backup restore, an edit of the status): a wiped status is not replayed to Failed.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from orbit_operator import kueue
from orbit_operator.decision import TIME_FORMAT, Decision, Plan, parse_time
from orbit_operator.fit import admission_fit
from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_operator.observe import JobView, Observed, observe
from orbit_operator.pod import build_configmap, build_pod, object_names
from orbit_operator.pod_health import (
    disrupted,
    disruption_reason,
    failure_reason,
    pending_reason,
    phase_of_pod,
    scheduled,
    terminating,
    unready,
)
from orbit_operator.settings import OperatorSettings
from orbit_operator.spec_changes import refused_changes
from orbit_operator.status import TERMINAL, backoff_seconds, learner_final_status, prepare_base_report, set_condition
from orbit_operator.validation import validate_job
from orbit_runtime.errors import OrbitError

__all__ = ["Observed", "Plan", "plan", "pod_rejected"]
WAIT_SECONDS = 2.0  # look again this soon while a ConfigMap we wait for (not watched) goes away


def _may_start_again(d: Decision) -> bool:
    """A Failed job that never ran because its spec was invalid or it did not fit its node may start once
    its spec was edited since (a new generation); nothing else leaves a terminal phase."""
    if d.status.get("phase") != "Failed" or d.status.get("startTime"):
        return False
    failed = d.old.get("Failed") or d.old.get("Invalid") or {}  # (a job failed as invalid by an earlier version: Invalid only)
    decided_at = failed.get("observedGeneration", d.view.status.get("observedGeneration"))
    return failed.get("reason") in ("InvalidSpec", "DoesNotFit") and decided_at != d.view.generation


def plan(observed: Observed, settings: OperatorSettings) -> Plan:
    view = observe(observed)
    member = kueue.membership(view, observed.job, settings.kueue)
    view.queue = member.queue  # Kueue manages it (kueue.py)
    return kueue.settle(_plan(view, observed, settings), view, observed.now, member)


def _plan(view: JobView, observed: Observed, settings: OperatorSettings) -> Plan:  # noqa: C901 - one decision table, top to bottom
    d, now, life = Decision(view, observed.now), observed.now, view.lifecycle
    status, phase = d.status, d.status.get("phase")

    # terminal stays terminal
    if phase in TERMINAL and not _may_start_again(d):
        if life.restartId != status.get("restartId", "") and status.get("ignoredRestartId") != life.restartId:
            d.event("Warning", "RestartIgnored", f"the job is {phase}: restartId {life.restartId!r} is ignored (create a new job)")
            status["ignoredRestartId"] = life.restartId
        d.applied = status.get("observedGeneration") == view.generation  # an edit of a finished job is not applied
        return d.finish(phase)

    # the spec: always checked, needed only to build a pod from it
    check = validate_job(observed.job, f"RLTrainingJob {view.namespace}/{view.name}", settings.max_gpus_per_node,
                         settings.allow_image_override, settings.pod_metadata_policy())  # fmt: skip
    spec: RLTrainingJobSpec | None = check.spec if check.ok else None
    invalid = "; ".join(check.errors)[:1000]
    if spec is None:
        if d.newly("Invalid", invalid):
            d.event("Warning", "Invalid", invalid)
        d.condition("Invalid", True, "InvalidSpec", invalid)
        d.applied = False
    else:
        d.drop("Invalid")
    if phase in TERMINAL:  # it never ran (Invalid or DoesNotFit), was edited since, and may start now
        if spec is None:  # still invalid: decided again for this generation
            d.condition("Failed", True, "InvalidSpec", invalid)
            return d.finish(phase)
        if (d.old.get("Failed") or {}).get("reason") == "InvalidSpec" or d.is_true("Invalid"):
            d.event("Normal", "SpecFixed", "the spec is valid now")
        d.drop("Failed")
        status.pop("completionTime", None)
        status["reapply"], phase = True, None  # its next pod takes the edited spec
    never_started = not status.get("startTime") and not view.owned
    if spec is None and never_started:
        d.condition("Failed", True, "InvalidSpec", invalid)
        d.condition("Ready", False, "InvalidSpec", "the spec is invalid")
        status.setdefault("completionTime", d.stamp)
        return d.finish("Failed")

    # does it fit its node? (before it ever starts)
    if spec is not None and not status.get("startTime") and not view.active:
        try:
            fit = admission_fit(spec, settings)
        except (OrbitError, ValueError) as exc:  # e.g. a linear the group size cannot split: the planner cannot judge it
            fit, status["plan"] = None, f"not planned: {exc}"[:500]
        if fit is not None and not fit.fits:
            message = fit.message()[:1000]
            old = d.old.get("Failed") or {}
            if old.get("reason") != "DoesNotFit" or old.get("message") != message:
                d.event("Warning", "DoesNotFit", message)
            d.condition("Failed", True, "DoesNotFit", message)
            d.condition("Ready", False, "DoesNotFit", "the job cannot fit its node")
            status.update(plan=fit.summary()[:500], completionTime=d.stamp)
            return d.finish("Failed")
        if fit is not None:
            status["plan"] = fit.summary()[:500]

    attempt, failures = view.attempt, view.failures
    status.update(attempt=attempt, failures=failures)
    pod_name = object_names(view.name, attempt)["pod"]
    pod = view.pod(pod_name)
    done = next((p for p in view.owned if p is not pod and phase_of_pod(p) == "Succeeded"), None)
    if done is not None:  # an earlier attempt's pod finished in its grace period (evicted, suspended, restarted): done
        d.condition("Complete", True, "LearnerSucceeded", f"pod {done['metadata']['name']} finished")
        d.condition("Ready", False, "Finished", "the job finished")
        return d.finish("Succeeded", Plan(status, delete_pods=view.active), completionTime=d.stamp)

    if life.suspend:
        d.condition("Suspended", True, "Suspended", "spec.suspend is true")
        if view.current_is_active:  # the next pod gets a new name: never confused with the one still terminating
            status["attempt"] = attempt + 1
        status["reapply"] = True
        status.pop("activeSince", None)  # the deadline restarts on resume
        return d.finish("Suspended", Plan(status, delete_pods=view.active))
    if d.is_true("Suspended"):
        d.condition("Suspended", False, "Resumed", "spec.suspend is false")

    if pod is not None and scheduled(pod) and not terminating(pod):
        status.setdefault("activeSince", d.stamp)  # the deadline counts from here, not while queued
    deadline = _deadline(status, life)
    if deadline is not None:
        if now >= deadline:
            d.condition("Failed", True, "DeadlineExceeded", f"ran longer than activeDeadlineSeconds ({life.activeDeadlineSeconds})")
            return d.finish("Failed", Plan(status, delete_pods=view.active), completionTime=d.stamp)

    if status.get("restartId", "") != life.restartId and "podName" not in status:
        status["restartId"] = life.restartId  # set from the start: nothing to restart
    if status.get("restartId", "") != life.restartId and spec is not None:  # an invalid spec cannot restart: Invalid says why
        d.event("Normal", "Restarting", f"restartId changed to {life.restartId!r}: a new pod with the current spec")
        status.update(restartId=life.restartId, reapply=True)
        if view.active:
            status["attempt"] = attempt + 1 if view.current_is_active else attempt
            return d.finish(phase or "Pending", Plan(status, delete_pods=view.active))
    reapply = bool(status.get("reapply")) or view.applied is None
    changes = [] if reapply or spec is None else refused_changes(view.applied, spec)
    if changes:
        message = "cannot change while the job runs (set a new restartId, or suspend and resume): " + "; ".join(changes)
        if d.newly("SpecChangeRefused", message[:900]):
            d.event("Warning", "SpecChangeRefused", "; ".join(changes)[:900])
        d.condition("SpecChangeRefused", True, "ImmutableWhileRunning", message[:900])
        d.applied = False
    else:
        d.drop("SpecChangeRefused")

    if pod is None:
        return _new_pod_plan(d, view, spec if reapply else view.applied, pod_name, settings, phase)
    return _follow_pod(d, view, pod, pod_name, settings, phase)


def _new_pod_plan(d: Decision, view: JobView, use: RLTrainingJobSpec | None, pod_name: str, settings: OperatorSettings,
                phase: str | None) -> Plan:  # fmt: skip
    """No pod of the current attempt: make one, unless something must go first."""
    status, now = d.status, d.now
    older = [name for name in view.active if name != pod_name]  # an earlier attempt's pod whose DELETE failed: again
    if older:
        d.condition("Ready", False, "WaitingForOldObjects", "deleting the pods of earlier attempts: " + ", ".join(older))
        return d.finish(phase or "Pending", Plan(status, delete_pods=older))  # its deletion is a pod event
    waiting = [*view.owned_terminating, *view.foreign] + ([f"ConfigMap {view.name}-config"] if view.foreign_configmap else [])
    if waiting:  # an old pod of ours, or a deleted job's objects of the same name, awaiting garbage collection
        d.condition("Ready", False, "WaitingForOldObjects", "waiting until these are gone: " + ", ".join(sorted(waiting))[:800])
        # a pod's deletion is a pod event; a ConfigMap's is not watched: look again soon
        return d.finish(phase or "Pending", Plan(status, requeue_after=WAIT_SECONDS if view.foreign_configmap else None))
    retry_at = parse_time(status.get("nextAttemptAt"))
    if retry_at is not None and now < retry_at:
        return d.finish(phase or "Pending", Plan(status, requeue_after=max(0.5, (retry_at - now).total_seconds())))
    if use is None:  # a (re)start needs the current spec, and it is invalid: the Invalid condition names the fields
        d.condition("Ready", False, "InvalidSpec", "the spec is invalid: fix it to start")
        return d.finish(phase or "Pending")
    attempt = status["attempt"]
    first_start = not status.get("startTime")  # only the job's first pod may refuse it for not fitting
    new_pod = build_pod(view.name, view.namespace, use, settings, attempt, enforce_fit=first_start)
    if view.queue is not None:  # Kueue's: no pod before its Workload is admitted
        new_pod = kueue.without_queue_label(new_pod)
        if (queued := kueue.gate_new_pod(d, view, new_pod)) is not None:
            return queued
    if phase == "Suspended" or first_start:
        status["startTime"] = d.stamp
    status["podName"] = pod_name
    reapply = bool(status.pop("reapply", None)) or view.applied is None
    status.pop("nextAttemptAt", None)
    d.condition("Ready", False, "PodCreated", f"pod {pod_name} created")
    d.event("Normal", "PodCreated", f"created pod {pod_name} (attempt {attempt})")
    configmap = build_configmap(view.name, view.namespace, use, settings) if reapply else None
    return d.finish("Pending", Plan(status, create_configmap=configmap, create_pod=new_pod))  # its changes are pod events


def _follow_pod(d: Decision, view: JobView, pod: dict, pod_name: str, settings: OperatorSettings, phase: str | None) -> Plan:
    """The current attempt's pod exists: the job's phase, readiness and progress follow it."""
    status, life, attempt, failures = d.status, view.lifecycle, d.status["attempt"], d.status["failures"]
    status["podName"] = pod_name  # also for a pod an operator created just before it died (adopted)
    status.setdefault("startTime", d.stamp)
    report = prepare_base_report(pod)
    if report and isinstance(report.get("plan"), str):
        status["plan"] = report["plan"][:500]
    _learner_progress(d, view)
    pod_phase = phase_of_pod(pod)
    if terminating(pod) and pod_phase not in ("Succeeded", "Failed"):  # deleted by someone else, or its node is gone:
        reason, message = unready(pod) or ("PodTerminating", f"pod {pod_name} is terminating")  # not ready, not polled,
        d.condition("Ready", False, reason, message)  # no new pod until it is gone (its deletion is a pod event)
        return d.finish(phase or "Pending")
    if view.queue is not None and pod_phase not in ("Succeeded", "Failed"):  # Kueue evicted (preempted) it: stop the pod
        if (evicted := kueue.gate_running_pod(d, view, pod_name)) is not None:
            return evicted
    if pod_phase == "Succeeded":  # what the pod did decides, even while it is being deleted
        d.condition("Complete", True, "LearnerSucceeded", f"pod {pod_name} finished")
        d.condition("Ready", False, "Finished", "the job finished")
        return d.finish("Succeeded", completionTime=d.stamp)
    if pod_phase == "Failed" and report and report.get("reason") == "DoesNotFit":
        # only the first pod enforces the plan: the learner never ran, so the job counts as never started
        # (an edit that makes it fit starts it, as after a refusal at admission) and its next pod gets a new name
        message = str(report.get("message", ""))[:1000]
        d.event("Warning", "DoesNotFit", message)
        d.condition("Failed", True, "DoesNotFit", message)
        d.condition("Ready", False, "DoesNotFit", "the job cannot fit its node")
        status.pop("startTime", None)
        return d.finish("Failed", completionTime=d.stamp, attempt=attempt + 1)
    if pod_phase == "Failed" and (disrupted(pod) or terminating(pod)):  # evicted, preempted, or deleted by someone else
        why = disruption_reason(pod)
        d.event("Warning", "PodDisrupted", f"pod {pod_name} was disrupted ({why}); a new pod resumes from the last checkpoint, "
                                           "not counted against backoffLimit")  # fmt: skip
        d.condition("Ready", False, "PodDisrupted", why[:900])
        status.update(attempt=attempt + 1)
        return d.finish("Pending", Plan(status, requeue_after=0.0))
    final = learner_final_status(pod) if pod_phase == "Failed" else None
    if final is not None and final.get("reason") == "OffPolicy":
        message = f"the learner stopped training off-policy: {_on_policy_figures(view)}"
        d.condition("Failed", True, "OffPolicy", message[:1000])
        d.condition("Ready", False, "OffPolicy", "the learner stopped")
        return d.finish("Failed", completionTime=d.stamp)
    if pod_phase == "Failed":
        failures += 1
        reason = failure_reason(pod)
        if failures > life.backoffLimit:
            d.condition("Failed", True, "BackoffLimitExceeded", f"{failures} pod failures, backoffLimit {life.backoffLimit}; last: {reason}")
            return d.finish("Failed", failures=failures, completionTime=d.stamp)
        delay = backoff_seconds(failures, base=settings.backoff_base_seconds)
        retry_at = d.now + timedelta(seconds=delay)
        d.event("Warning", "PodFailed", f"pod {pod_name} failed ({reason}); new pod in {delay:.0f}s "
                                        f"({failures}/{life.backoffLimit} failures)")  # fmt: skip
        d.condition("Ready", False, "PodFailed", reason)
        status.update(failures=failures, attempt=attempt + 1, nextAttemptAt=retry_at.strftime(TIME_FORMAT))
        return d.finish("Pending", Plan(status, requeue_after=delay))
    if pod_phase == "Running":
        why = unready(pod)
        d.condition("Ready", why is None, *(why or ("PodRunning", f"pod {pod_name} is running")))
    else:
        waiting = pending_reason(pod)
        d.condition("Ready", False, "PodWaiting" if waiting else "PodStarting", waiting or f"pod {pod_name} is {pod_phase.lower()}")
    # a running learner is polled for its progress; anything else changes by pod events (and the deadline)
    poll = settings.status_poll_seconds if pod_phase == "Running" else None
    return d.finish(pod_phase, Plan(status, requeue_after=_sooner(poll, _deadline_in(status, life, d.now))))


def _deadline(status: dict, life) -> datetime | None:
    """When activeDeadlineSeconds runs out: counted from activeSince (the pod left the queue)."""
    active_since = parse_time(status.get("activeSince"))
    if life.activeDeadlineSeconds is None or active_since is None:
        return None
    return active_since + timedelta(seconds=life.activeDeadlineSeconds)


def _deadline_in(status: dict, life, now: datetime) -> float | None:
    deadline = _deadline(status, life)
    return None if deadline is None else max(0.5, (deadline - now).total_seconds())


def _sooner(*delays: float | None) -> float | None:
    known = [d for d in delays if d is not None]
    return min(known) if known else None


def _on_policy_figures(view: JobView) -> str:
    health = view.report.on_policy if view.report is not None else None
    if health is None or health.bound is None:
        return "algorithm.max_mismatch exceeded"
    return (f"mean |dlogp| {health.lastMismatch if health.lastMismatch is not None else float('nan'):.4g} above the bound "
            f"{health.bound:.4g} for {health.consecutiveSteps} consecutive steps (allowed {health.allowedSteps})")  # fmt: skip


def _learner_progress(d: Decision, view: JobView) -> None:
    """status.progress and the OnPolicy condition from the learner's /status; what does not parse is
    ignored and reported once (a warning event), never a failed reconcile."""
    if view.report_error:
        if d.status.get("learnerStatusError") != view.report_error:
            d.event("Warning", "LearnerStatusInvalid", view.report_error[:900])
        d.status["learnerStatusError"] = view.report_error[:900]
    elif view.report is not None:
        d.status.pop("learnerStatusError", None)
    if view.report is None:
        return
    d.status["progress"] = view.report.progress(d.status.get("progress"))
    health = view.report.on_policy
    if health is None or health.state is None:
        return
    verdict = {"ok": (True, "WithinBound"), "exceeded": (False, "MismatchAboveBound"), "calibrating": (None, "Calibrating"),
               "off": (None, "NoBound")}.get(health.state, (None, "Unknown"))  # fmt: skip
    if health.state == "off":
        message = "algorithm.max_mismatch is off: nothing bounds the train-rollout mismatch"
    elif health.state == "calibrating":
        message = "algorithm.max_mismatch: auto, calibrating its bound from the first steps"
    else:
        message = _on_policy_figures(view)
    old = (d.old.get("OnPolicy") or {}).get("status")
    d.condition("OnPolicy", verdict[0], verdict[1], message)
    new = next(c["status"] for c in d.conditions if c.get("type") == "OnPolicy")
    if old is not None and old != new or (old is None and new == "False"):
        d.event("Warning" if new == "False" else "Normal", "OnPolicy", f"OnPolicy {new}: {message}"[:900])


def pod_rejected(status: dict, message: str, now: datetime, generation: int | None = None) -> dict:
    """The status after the API server refused the job's pod for good (403 by Pod Security admission,
    422 for a malformed toleration, a missing priority class, ...): Failed, with the server's reason."""
    stamp = now.strftime(TIME_FORMAT)
    conditions = set_condition(list(status.get("conditions") or []), "Failed", True, "PodRejected", message[:1000], stamp, generation)
    return {**status, "phase": "Failed", "conditions": conditions, "completionTime": stamp}
