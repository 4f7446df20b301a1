"""Kueue: the operator as the job-framework controller of RLTrainingJob (Kueue's external frameworks).
Pure functions: no API calls.

One `Workload` per job, not one per pod attempt: the operator makes a pod per attempt itself (backoff,
resume from the checkpoint, restartId), so a batch/v1 Job or Kueue's pod integration would queue each
attempt apart. The contract, as Kueue's jobframework reconciler (pkg/controller/jobframework) keeps it:

- a job carrying the label `kueue.x-k8s.io/queue-name` (on its metadata; in spec.podLabels also
  accepted, for jobs written before) is Kueue's, when the operator runs with ORBIT_KUEUE=true;
- the operator creates its Workload (`rltrainingjob-<name>-<hash>`, Kueue's naming; the job is its
  controller owner; label `kueue.x-k8s.io/job-uid`) with one pod set `main` of count 1 whose
  template is the pod the operator would create; no pod until Kueue admits it (the job is
  "suspended first": phase Queued, condition Queued);
- admitted (condition Admitted True and status.admission set): the pod is created;
- evicted (condition Evicted True, e.g. preempted) or no longer admitted: the pod is deleted (its
  learner checkpoints on SIGTERM), not counted against backoffLimit; once no pod of the job runs the
  operator releases the admission (QuotaReserved False, admission cleared, Requeued), which is the
  job controller's part; Kueue admits it again and a new pod resumes from the checkpoint;
- the job finished: the Workload gets condition Finished True (reason Succeeded or Failed);
- spec.suspend sets the Workload's spec.active to false (Kueue then evicts it, reason Deactivated,
  and the quota is released as above), and resuming back to true (it queues again).

- PodsReady mirrors the job's Ready condition while admitted (Kueue's waitForPodsReady): False/WaitForStart,
  True/Started (Recovered after a recovery), False/WaitForRecovery once a ready pod is gone;
- the priority: a job's priorityClassName is resolved to its PriorityClass's value (spec.priority), as Kueue's
  Job integration does (the handlers read it: `with_priority`);
- once a Workload exists it decides the queue (its spec.queueName): a changed label is patched into it while
  no quota is reserved; the label added or removed while the pod runs is refused (SpecChangeRefused);
- a (re)start whose pod requests other resources than the Workload's pod set re-creates the Workload while no
  quota is reserved; with quota reserved the job runs on the old one (condition WorkloadOutdated).

Not done: the admission's ResourceFlavor nodeLabels/tolerations are not injected into the pod (that
needs reading ResourceFlavors, cluster-scoped), partial admission, Kueue's resource-in-use finalizer.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from datetime import datetime

from orbit_operator.crd import GROUP, KIND
from orbit_operator.decision import TIME_FORMAT, Decision, Plan
from orbit_operator.observe import JobView
from orbit_operator.pod import LABEL_JOB
from orbit_operator.status import TERMINAL, set_condition

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta1"
WORKLOADS = "workloads"
QUEUE_LABEL = f"{KUEUE_GROUP}/queue-name"
JOB_UID_LABEL = f"{KUEUE_GROUP}/job-uid"
POD_SET = "main"
PRIORITY_SOURCE = "scheduling.k8s.io/priorityclass"
REQUEUED_ON = ("Preempted", "NodeFailures")  # eviction reasons after which Kueue requeues at once (Requeued True)


def queue_name(job: dict) -> str | None:
    """The job's local queue: the label on its metadata, else (older jobs) in spec.podLabels."""
    labels = (job.get("metadata") or {}).get("labels") or {}
    if isinstance(labels.get(QUEUE_LABEL), str) and labels[QUEUE_LABEL]:
        return labels[QUEUE_LABEL]
    spec = job.get("spec") if isinstance(job.get("spec"), dict) else {}
    pod_labels = spec.get("podLabels") if isinstance(spec.get("podLabels"), dict) else {}
    value = pod_labels.get(QUEUE_LABEL)
    return value if isinstance(value, str) and value else None


def workload_name(job_name: str, uid: str) -> str:
    """Kueue's jobframework name: `<kind>-<name>` (at most 247 characters) and 5 hex of a digest of the
    kind, group, name and UID: a re-created job of the same name gets another Workload."""
    digest = hashlib.sha1(f"{KIND}\n{GROUP}\n{job_name}\n{uid}".encode()).hexdigest()[:5]
    return f"{KIND.lower()}-{job_name}"[:247] + f"-{digest}"


def without_queue_label(pod: dict) -> dict:
    """The pod of a Kueue-managed job without the queue-name label (from spec.podLabels): Kueue's pod
    integration would otherwise queue the pod as a second workload."""
    pod = copy.deepcopy(pod)
    (pod.get("metadata") or {}).get("labels", {}).pop(QUEUE_LABEL, None)
    return pod


def build_workload(job_name: str, namespace: str, uid: str, pod: dict, queue: str) -> dict:
    """The job's Workload: one pod set `main`, count 1, with POD's labels, annotations and spec (the
    handlers add the controller ownerReference)."""
    pod_meta = pod.get("metadata") or {}
    template = {"metadata": {"labels": dict(pod_meta.get("labels") or {}), "annotations": dict(pod_meta.get("annotations") or {})},
                "spec": copy.deepcopy(pod["spec"])}  # fmt: skip
    spec: dict = {"queueName": queue, "podSets": [{"name": POD_SET, "count": 1, "template": template}]}
    if pod["spec"].get("priorityClassName"):
        spec["priorityClassName"] = pod["spec"]["priorityClassName"]
        spec["priorityClassSource"] = PRIORITY_SOURCE  # Kueue's CEL then wants spec.priority: with_priority
    return {
        "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
        "kind": "Workload",
        "metadata": {"name": workload_name(job_name, uid), "namespace": namespace,
                     "labels": {JOB_UID_LABEL: uid, LABEL_JOB: job_name}},
        "spec": spec,
    }  # fmt: skip


def priority_class_of(workload: dict) -> str | None:
    """The PriorityClass whose value the Workload still needs (None: none, or it has its priority)."""
    spec = workload["spec"]
    return spec.get("priorityClassName") if spec.get("priorityClassName") and "priority" not in spec else None


def with_priority(workload: dict, value: int) -> dict:
    """WORKLOAD with the PriorityClass's VALUE as spec.priority (Kueue's jobframework reads the class too)."""
    workload["spec"]["priority"] = int(value)
    return workload


def _requests(template: dict | None) -> list:
    """What Kueue accounts of a pod template: each container's and init container's resources, and overhead."""
    spec = (template or {}).get("spec") or {}
    return [[(c.get("name"), c.get("resources") or {}) for c in spec.get(key) or [] if isinstance(c, dict)]
            for key in ("initContainers", "containers")] + [spec.get("overhead") or {}]  # fmt: skip


def requests_differ(workload: dict, pod: dict) -> bool:
    """Does POD request other resources than the Workload's pod set (a restart or resume with another spec)?"""
    pod_sets = (workload.get("spec") or {}).get("podSets") or [{}]
    return _requests(pod_sets[0].get("template") if isinstance(pod_sets[0], dict) else None) != _requests(pod)


def workload_queue(workload: dict | None) -> str:
    return str(((workload or {}).get("spec") or {}).get("queueName") or "")


def _conditions(workload: dict | None) -> list[dict]:
    """The Workload's status conditions (what is not a condition object is left out)."""
    found = ((workload or {}).get("status") or {}).get("conditions")
    return [c for c in found if isinstance(c, dict)] if isinstance(found, list) else []


def _condition(workload: dict | None, type_: str) -> dict:
    return next((c for c in _conditions(workload) if c.get("type") == type_), {})


def _true(workload: dict | None, type_: str) -> bool:
    return _condition(workload, type_).get("status") == "True"


@dataclass(frozen=True)
class WorkloadState:
    """What the job's Workload says (absent: not created yet)."""

    exists: bool
    deleting: bool  # deletionTimestamp set (re-created for other requests, or deleted by someone): not admitted
    admitted: bool  # Admitted True and status.admission set, not evicted: the pod may run
    evicted: bool
    quota_reserved: bool
    finished: bool
    cluster_queue: str
    reason: str  # why it is not admitted (the eviction's or Admitted's reason), or ""
    message: str


def state_of(workload: dict | None) -> WorkloadState:
    status = (workload or {}).get("status") or {}
    admission = status.get("admission") if isinstance(status.get("admission"), dict) else None
    evicted, finished = _true(workload, "Evicted"), _true(workload, "Finished")
    deleting = bool(((workload or {}).get("metadata") or {}).get("deletionTimestamp"))
    why = _condition(workload, "Evicted") if evicted else _condition(workload, "Admitted")
    return WorkloadState(
        exists=workload is not None, deleting=deleting, evicted=evicted, quota_reserved=_true(workload, "QuotaReserved"),
        admitted=admission is not None and _true(workload, "Admitted") and not (evicted or finished or deleting), finished=finished,
        cluster_queue=str((admission or {}).get("clusterQueue", "")), reason=str(why.get("reason", "")),
        message=str(why.get("message", ""))[:500],
    )  # fmt: skip


def _set(
    conditions: list[dict], type_: str, value: bool, reason: str, message: str, stamp: str, generation: int | None
) -> list[dict]:
    """metav1.Condition semantics: one per type; lastTransitionTime moves only when the status changes."""
    old = next((c for c in conditions if c.get("type") == type_), None)
    status = "True" if value else "False"
    new = {"type": type_, "status": status, "reason": reason, "message": message[:32768],
           "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime")
           else stamp}  # fmt: skip
    if generation is not None:
        new["observedGeneration"] = generation
    return [new if c is old else c for c in conditions] if old else [*conditions, new]


def _patch(workload: dict, conditions: list[dict], **fields) -> dict:
    """A merge patch of the Workload's status (the whole conditions list), guarded by its resourceVersion:
    Kueue writing in between makes it a 409, and the next reconcile decides again."""
    return {"metadata": {"resourceVersion": workload["metadata"].get("resourceVersion")},
            "status": {"conditions": conditions, **fields}}  # fmt: skip


def finished_patch(workload: dict, succeeded: bool, message: str, stamp: str) -> dict | None:
    """The job is Succeeded or Failed: condition Finished True on its Workload (None if it has it)."""
    if state_of(workload).finished:
        return None
    conditions = _conditions(workload)
    generation = workload["metadata"].get("generation")
    conditions = _set(conditions, "Finished", True, "Succeeded" if succeeded else "Failed", message or "the job finished", stamp,
                      generation)  # fmt: skip
    return _patch(workload, conditions)


def release_patch(workload: dict, stamp: str) -> dict | None:
    """An evicted Workload whose job has no pod running any more: release the quota as the job controller
    does (Requeued, QuotaReserved False, Admitted False, admission cleared); None if nothing to release."""
    state = state_of(workload)
    if not state.evicted or not (state.quota_reserved or (workload.get("status") or {}).get("admission")):
        return None
    generation = workload["metadata"].get("generation")
    conditions = _conditions(workload)
    conditions = _set(
        conditions, "Requeued", state.reason in REQUEUED_ON, state.reason or "Evicted", state.message, stamp, generation
    )
    conditions = _set(conditions, "QuotaReserved", False, "Pending", state.message or "evicted", stamp, generation)
    conditions = _set(conditions, "Admitted", False, "NoReservation", "The workload has no reservation", stamp, generation)
    if _condition(workload, "PodsReady"):  # not admitted: as the jobframework writes it then
        conditions = _set(conditions, "PodsReady", False, "WaitForStart", NOT_READY, stamp, generation)
    return _patch(workload, conditions, admission=None)


NOT_READY, READY = "Not all pods are ready or succeeded", "All pods reached readiness and the workload is running"
RECOVERING = "At least one pod has failed, waiting for recovery"


def pods_ready(workload: dict, ready: bool) -> tuple[bool, str, str]:
    """The PodsReady condition the jobframework derives for an admitted Workload (reconciler.go): True/Started
    (Recovered after a recovery) while the pod is ready; False/WaitForRecovery once a ready pod is gone, until it
    is ready again; False/WaitForStart before it ever was. Kueue's waitForPodsReady evicts on its timeouts."""
    old = _condition(workload, "PodsReady")
    if ready:
        return True, "Recovered" if old.get("reason") in ("WaitForRecovery", "Recovered") else "Started", READY
    if old.get("status") == "True" or old.get("reason") == "WaitForRecovery":
        return False, "WaitForRecovery", RECOVERING
    return False, "WaitForStart", NOT_READY


def pods_ready_patch(workload: dict, ready: bool, stamp: str) -> dict | None:
    """The admitted Workload's PodsReady, patched only when its status or reason changes (None otherwise)."""
    value, reason, message = pods_ready(workload, ready)
    old = _condition(workload, "PodsReady")
    if old.get("status") == ("True" if value else "False") and old.get("reason") == reason:
        return None
    conditions = _set(_conditions(workload), "PodsReady", value, reason, message, stamp, workload["metadata"].get("generation"))
    return _patch(workload, conditions)


# ---- the job's side: decisions plan() calls -------------------------------------------------------


@dataclass(frozen=True)
class Membership:
    """Is the job Kueue's this reconcile, and under which queue (plan() sets view.queue from it)."""

    enabled: bool  # ORBIT_KUEUE
    label: str | None  # the queue label as the job carries it now
    queue: str | None  # the queue it is gated on: its Workload's once one exists; None: not Kueue's
    refused: str = ""  # a label change the running pod cannot take (SpecChangeRefused names it)
    leave: bool = False  # the label was removed while no pod runs: delete the Workload, run outside Kueue


def membership(view: JobView, job: dict, enabled: bool) -> Membership:
    """The queue label decides when there is no Workload yet; once there is one its spec.queueName does (a
    changed label is patched into it while no quota is reserved: settle). Adding or removing the label while the
    pod runs is refused, as Kueue's webhook refuses changing a running Job's queue: the pod is never deleted for it."""
    label = queue_name(job)
    if not enabled:
        return Membership(False, label, None)
    if view.workload is not None:
        if label is None and not view.active:  # removed between pods: the next one runs outside Kueue
            return Membership(True, None, None, leave=True)
        if label is not None:
            return Membership(True, label, workload_queue(view.workload) or label)
        return Membership(True, label, workload_queue(view.workload), f"label {QUEUE_LABEL} removed while the pod runs: the job "
                          "stays in Kueue until its next start (restartId, suspend and resume, a retry)")  # fmt: skip
    was_admitted = any(c.get("type") == "Admitted" for c in view.status.get("conditions") or [] if isinstance(c, dict))
    if label is not None and view.active and not was_admitted:  # it ran outside Kueue: a deleted Workload is not this
        return Membership(True, label, None, f"label {QUEUE_LABEL} added while the pod runs outside Kueue: it queues at "
                          "its next start (restartId, suspend and resume, a retry)")  # fmt: skip
    return Membership(True, label, label)


def gate_new_pod(d: Decision, view: JobView, pod: dict) -> Plan | None:
    """Before the job's pod is created: create the Workload, or wait for its admission (phase Queued);
    None once it is admitted (the pod may be created)."""
    state, queue = state_of(view.workload), view.queue or ""
    if state.finished:  # a job that failed before it ran (DoesNotFit in prepare-base), edited since: Kueue is done with it
        d.condition("Queued", True, "WorkloadFinished", "its Workload is Finished: re-create the job to queue it again")
        return d.finish("Queued")
    name = workload_name(view.name, view.uid)
    recreate = state.exists and not state.deleting and not state.quota_reserved and requests_differ(view.workload, pod)
    if state.exists and not (recreate or state.deleting) and requests_differ(view.workload, pod):  # quota held for the old ones
        d.condition("WorkloadOutdated", True, "QuotaReserved", f"the pod's resources changed (restart or resume) while Workload "
                    f"{name} holds quota for the old ones: Kueue accounts those until it is admitted again")  # fmt: skip
    elif not recreate:
        d.drop("WorkloadOutdated")
    if not state.admitted or recreate:
        why = f"evicted ({state.reason}): " if state.evicted else ""
        if recreate:
            d.event("Normal", "WorkloadRecreated", f"the pod's resources changed: Workload {name} is re-created to queue with them")
            why = "re-created for the changed resources: "
        elif state.deleting:
            why = "the old Workload is being deleted: "
        d.condition(
            "Queued", True, "WaitingForAdmission", f"{why}waiting for Kueue to admit Workload {name} (queue {queue})"[:900]
        )
        d.condition("Admitted", False, state.reason or "Pending", state.message or "not admitted yet")
        d.condition("Ready", False, "Queued", "waiting for Kueue's admission")
        created = None if state.exists and not recreate else build_workload(view.name, view.namespace, view.uid, pod, queue)
        return d.finish("Queued", Plan(d.status, create_workload=created, delete_workload=recreate))  # admission: a Workload event
    if not d.is_true("Admitted"):
        d.event("Normal", "Admitted", f"Kueue admitted the job in ClusterQueue {state.cluster_queue}")
    d.condition("Queued", False, "Admitted", f"admitted in ClusterQueue {state.cluster_queue}")
    d.condition("Admitted", True, "Admitted", f"admitted in ClusterQueue {state.cluster_queue}")
    return None


def gate_running_pod(d: Decision, view: JobView, pod_name: str) -> Plan | None:
    """The job's pod runs: if its Workload is evicted (preempted, ...), deleted or no longer admitted, delete the
    pod (the learner checkpoints on SIGTERM), without counting a failure; the job is Queued again."""
    state = state_of(view.workload)
    if state.admitted:
        return None
    reason = state.reason if state.evicted and state.reason else "NotAdmitted" if state.exists else "WorkloadMissing"
    message = f"Kueue: {state.message or reason}"[:800]
    d.event("Warning", "Evicted", f"{message}; pod {pod_name} deleted, a new pod resumes from the last checkpoint once admitted "
                                  "again (not counted against backoffLimit)")  # fmt: skip
    d.condition("Admitted", False, reason, message)
    d.condition("Queued", True, "Evicted", message)
    d.condition("Ready", False, "Evicted", message)
    if view.current_is_active:  # the next pod gets a new name: never confused with the one still terminating
        d.status["attempt"] = d.status["attempt"] + 1
    d.status.pop("activeSince", None)  # the deadline restarts on re-admission, as a suspended Job's
    return d.finish("Queued", Plan(d.status, delete_pods=view.active))


def workload_refused(status: dict, message: str, now: datetime, generation: int | None) -> dict:
    """The status after the API server refused the job's Workload (a 422, a missing PriorityClass, ...): Queued with
    the reason, tried again after a backoff (the handlers post its event once)."""
    conditions = set_condition(list(status.get("conditions") or []), "Queued", True, "WorkloadRejected", message[:1000],
                               now.strftime(TIME_FORMAT), generation)  # fmt: skip
    return {**status, "conditions": conditions}


def _note(result: Plan, view: JobView, type_: str, value: bool, reason: str, message: str, stamp: str) -> bool:
    """Set a condition on RESULT's status after the job's plan (its time kept if unchanged); True if it is new."""
    conditions = [c for c in result.status.get("conditions") or [] if c.get("type") != type_]
    old = next((c for c in view.status.get("conditions") or [] if isinstance(c, dict) and c.get("type") == type_), None)
    result.status["conditions"] = set_condition([*conditions, *([old] if old else [])], type_, value, reason, message, stamp,
                                                view.generation)  # fmt: skip
    return not (old and old.get("status") == ("True" if value else "False") and old.get("message") == message)


def settle(result: Plan, view: JobView, now: datetime, member: Membership | None = None) -> Plan:
    """The Workload's side of the job controller's contract, after the job's plan: Finished when the job is,
    PodsReady while admitted, the queue name while no quota is reserved, the admission released once an evicted
    job has no pod running; the label's refused changes, and a label Kueue-less operators ignore."""
    stamp, phase = now.strftime(TIME_FORMAT), result.status.get("phase")
    member = member or Membership(True, view.queue, view.queue)
    if not member.enabled and member.label is not None and phase not in TERMINAL:
        if _note(result, view, "Queued", False, "KueueDisabled", f"label {QUEUE_LABEL} is set but the operator runs without "
                 "Kueue (kueue.enabled): the job runs outside Kueue", stamp):  # fmt: skip
            result.events.append(("Warning", "KueueDisabled", f"label {QUEUE_LABEL}={member.label}: the operator runs without "
                                  "Kueue (kueue.enabled false), so the job runs outside Kueue"))  # fmt: skip
    refusing = any(c.get("type") == "SpecChangeRefused" and c.get("status") == "True" for c in result.status.get("conditions") or [])
    if member.refused and phase not in TERMINAL and not refusing:  # a refused spec change shows first; this one after
        if _note(result, view, "SpecChangeRefused", True, "QueueLabelChanged", member.refused, stamp):
            result.events.append(("Warning", "SpecChangeRefused", member.refused))
    if view.workload is None:
        return result
    state = state_of(view.workload)
    if member.leave and phase not in TERMINAL and not view.active:  # the label was removed: no longer Kueue's
        result.delete_workload, result.create_workload = True, None
        result.status["conditions"] = [c for c in result.status.get("conditions") or [] if c.get("type") not in ("Queued", "Admitted")]
        result.events.append(("Normal", "LeftKueue", f"label {QUEUE_LABEL} removed: Workload deleted, the job runs outside Kueue"))
        return result
    spec = view.workload.get("spec") or {}
    if member.label and member.label != workload_queue(view.workload) and not state.quota_reserved and phase not in TERMINAL:
        result.workload_queue = member.label  # Kueue's QueueNameChange: allowed while no quota is reserved
    if phase not in TERMINAL and view.queue is not None and (spec.get("active", True) is not False) == view.lifecycle.suspend:
        result.workload_active = not view.lifecycle.suspend  # suspended: Kueue evicts it and frees its quota
    if phase in TERMINAL:
        cond = next((c for c in result.status.get("conditions") or [] if c.get("type") == ("Complete" if phase == "Succeeded"
                                                                                          else "Failed")), {})  # fmt: skip
        result.workload_patch = finished_patch(view.workload, phase == "Succeeded", str(cond.get("message", "")), stamp)
    elif state.admitted and not result.delete_workload:
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in result.status.get("conditions") or [])
        result.workload_patch = pods_ready_patch(view.workload, ready, stamp)
    elif not any((p.get("status") or {}).get("phase") not in ("Succeeded", "Failed") for p in view.owned):
        result.workload_patch = release_patch(view.workload, stamp)
    return result
