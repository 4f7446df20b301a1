"""Kueue (orbit_operator.kueue): the Workload the operator builds for a job, what it reads of Kueue's
admission and eviction, and plan()'s gate (no pod before admission, eviction not counted as a failure).
No Kueue runs here: the tests write the Workload's status as Kueue would."""

from __future__ import annotations

import copy
import hashlib

from orbit_operator import kueue
from orbit_operator.pod import build_pod
from orbit_operator.reconcile import Observed, plan
from orbit_operator.settings import OperatorSettings
from orbit_operator.validation import validate_job
from tests.unit.test_operator_reconcile import JOB, OWNER, T0, configmap, pod

KUEUE = OperatorSettings(kueue=True)
STAMP = "2026-11-30T12:00:00Z"


def queued_job(status=None, queue="team-a", where="metadata"):
    out = copy.deepcopy(JOB)
    if where == "metadata":
        out["metadata"].setdefault("labels", {})[kueue.QUEUE_LABEL] = queue
    else:
        out["spec"]["podLabels"] = {kueue.QUEUE_LABEL: queue}
    if status is not None:
        out["status"] = status
    return out


def workload(conditions=(), admission=None, owner=OWNER, rv="7"):
    """The job's Workload with the status Kueue wrote: CONDITIONS as {type: (status, reason)}."""
    built = kueue.build_workload("quickstart-cpu", "default", "u-1", build_pod("quickstart-cpu", "default",
                                 validate_job(JOB).spec, KUEUE), "team-a")  # fmt: skip
    built["metadata"].update(ownerReferences=[owner], resourceVersion=rv, generation=1)
    conds = [
        {"type": t, "status": s, "reason": r, "message": f"{t} {r}", "lastTransitionTime": STAMP}
        for t, (s, r) in dict(conditions).items()
    ]
    built["status"] = {"conditions": conds, **({"admission": admission} if admission else {})}
    return built


ADMISSION = {"clusterQueue": "cq-gpu", "podSetAssignments": [{"name": "main", "flavors": {"nvidia.com/gpu": "h200"}, "count": 1}]}
ADMITTED = workload({"QuotaReserved": ("True", "QuotaReserved"), "Admitted": ("True", "Admitted")}, ADMISSION)
EVICTED = workload({"QuotaReserved": ("True", "QuotaReserved"), "Admitted": ("True", "Admitted"),
                    "Evicted": ("True", "Preempted")}, ADMISSION)  # fmt: skip


def conditions(decided) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in decided.status["conditions"]}


def test_the_queue_name_comes_from_the_job_label_or_its_pod_labels():
    assert kueue.queue_name(queued_job()) == "team-a"
    assert kueue.queue_name(queued_job(queue="team-b", where="podLabels")) == "team-b"
    assert kueue.queue_name(JOB) is None
    assert kueue.queue_name({"metadata": {"labels": {kueue.QUEUE_LABEL: ""}}, "spec": "garbage"}) is None


def test_the_workload_name_is_kueue_s_and_changes_with_the_uid():
    digest = hashlib.sha1(b"RLTrainingJob\norbit.dev\nquickstart-cpu\nu-1").hexdigest()[:5]
    assert kueue.workload_name("quickstart-cpu", "u-1") == f"rltrainingjob-quickstart-cpu-{digest}"
    assert kueue.workload_name("quickstart-cpu", "u-2") != kueue.workload_name("quickstart-cpu", "u-1")
    assert len(kueue.workload_name("x" * 253, "u")) == 253


def test_the_workload_has_one_pod_set_with_the_pod_s_template():
    spec = validate_job(queued_job()).spec
    spec = spec.model_copy(update={"priorityClassName": "rl-high"})
    the_pod = build_pod("quickstart-cpu", "default", spec, KUEUE)
    built = kueue.build_workload("quickstart-cpu", "default", "u-1", the_pod, "team-a")
    assert built["apiVersion"] == "kueue.x-k8s.io/v1beta1" and built["kind"] == "Workload"
    assert built["metadata"]["labels"][kueue.JOB_UID_LABEL] == "u-1"
    assert built["spec"]["queueName"] == "team-a" and built["spec"]["priorityClassName"] == "rl-high"
    (pod_set,) = built["spec"]["podSets"]
    assert pod_set["name"] == "main" and pod_set["count"] == 1
    assert pod_set["template"]["spec"] == the_pod["spec"] and "name" not in pod_set["template"]["metadata"]


def test_a_queued_job_gets_its_workload_and_no_pod():
    decided = plan(Observed(queued_job(), [], None, T0), KUEUE)
    assert decided.create_pod is None and decided.create_configmap is None
    assert decided.create_workload["metadata"]["name"] == kueue.workload_name("quickstart-cpu", "u-1")
    assert decided.status["phase"] == "Queued" and conditions(decided)["Queued"] == ("True", "WaitingForAdmission")
    again = plan(Observed(queued_job(decided.status), [], None, T0, workload=workload()), KUEUE)
    assert again.create_workload is None and again.create_pod is None and again.status["phase"] == "Queued"
    # a Workload that is not ours (a deleted job's of the same name) does not admit this one
    foreign = plan(Observed(queued_job(decided.status), [], None, T0, workload=workload(owner={**OWNER, "uid": "u-0"})), KUEUE)
    assert foreign.create_pod is None


def test_without_kueue_enabled_or_a_queue_name_the_pod_is_created_at_once():
    assert plan(Observed(queued_job(), [], None, T0), OperatorSettings()).create_pod is not None
    decided = plan(Observed(copy.deepcopy(JOB), [], None, T0), KUEUE)
    assert decided.create_pod is not None and decided.create_workload is None and "Queued" not in conditions(decided)


def test_admission_creates_the_pod_without_the_queue_label():
    status = plan(Observed(queued_job(where="podLabels"), [], None, T0), KUEUE).status
    decided = plan(Observed(queued_job(status, where="podLabels"), [], None, T0, workload=ADMITTED), KUEUE)
    assert decided.create_pod["metadata"]["name"] == "quickstart-cpu-0" and decided.status["phase"] == "Pending"
    assert kueue.QUEUE_LABEL not in decided.create_pod["metadata"]["labels"]  # Kueue's pod integration would queue it again
    assert conditions(decided)["Admitted"] == ("True", "Admitted") and conditions(decided)["Queued"] == ("False", "Admitted")
    assert any(e[1] == "Admitted" and "cq-gpu" in e[2] for e in decided.events)


def test_eviction_deletes_the_running_pod_without_counting_a_failure_then_releases_the_quota():
    running = {"phase": "Running", "attempt": 0, "failures": 0, "podName": "quickstart-cpu-0", "startTime": STAMP,
               "activeSince": STAMP}  # fmt: skip
    live = pod("quickstart-cpu-0", "Running", podIP="127.0.0.5")
    decided = plan(Observed(queued_job(running), [live], configmap(JOB), T0, workload=EVICTED), KUEUE)
    assert decided.delete_pods == ["quickstart-cpu-0"] and decided.create_pod is None
    assert decided.status["phase"] == "Queued" and decided.status["attempt"] == 1 and decided.status["failures"] == 0
    assert "activeSince" not in decided.status and conditions(decided)["Admitted"] == ("False", "Preempted")
    assert any(e[1] == "Evicted" for e in decided.events)
    assert decided.workload_patch is None  # the pod still runs (it checkpoints): the quota is not released yet

    gone = plan(Observed(queued_job(decided.status), [], configmap(JOB), T0, workload=EVICTED), KUEUE)
    assert gone.create_pod is None and gone.status["phase"] == "Queued" and gone.status["failures"] == 0
    patch = gone.workload_patch
    assert patch["metadata"]["resourceVersion"] == "7" and patch["status"]["admission"] is None
    released = {c["type"]: (c["status"], c["reason"]) for c in patch["status"]["conditions"]}
    assert released["QuotaReserved"] == ("False", "Pending") and released["Admitted"] == ("False", "NoReservation")
    assert released["Requeued"] == ("True", "Preempted") and released["Evicted"] == ("True", "Preempted")

    readmitted = plan(Observed(queued_job(gone.status), [], configmap(JOB), T0, workload=ADMITTED), KUEUE)
    assert readmitted.create_pod["metadata"]["name"] == "quickstart-cpu-1" and readmitted.status["failures"] == 0


def test_a_finished_job_marks_its_workload_finished_once():
    running = {"phase": "Running", "attempt": 0, "failures": 0, "podName": "quickstart-cpu-0", "startTime": STAMP}
    done = plan(
        Observed(queued_job(running), [pod("quickstart-cpu-0", "Succeeded")], configmap(JOB), T0, workload=ADMITTED), KUEUE
    )
    assert done.status["phase"] == "Succeeded"
    finished = {c["type"]: (c["status"], c["reason"]) for c in done.workload_patch["status"]["conditions"]}
    assert finished["Finished"] == ("True", "Succeeded") and "admission" not in done.workload_patch["status"]
    marked = copy.deepcopy(ADMITTED)
    marked["status"]["conditions"] = done.workload_patch["status"]["conditions"]
    assert plan(Observed(queued_job(done.status), [], configmap(JOB), T0, workload=marked), KUEUE).workload_patch is None
    failed = kueue.finished_patch(ADMITTED, False, "BackoffLimitExceeded", STAMP)
    assert {c["type"]: c["reason"] for c in failed["status"]["conditions"]}["Finished"] == "Failed"


def test_workload_state_reads_kueue_s_conditions():
    assert not kueue.state_of(None).exists
    pending = kueue.state_of(workload({"QuotaReserved": ("False", "Pending")}))
    assert pending.exists and not pending.admitted and not pending.evicted
    assert kueue.state_of(ADMITTED).admitted and kueue.state_of(ADMITTED).cluster_queue == "cq-gpu"
    no_admission = workload({"Admitted": ("True", "Admitted")})  # a condition without status.admission: not admitted
    assert not kueue.state_of(no_admission).admitted
    assert (
        kueue.state_of(EVICTED).evicted and not kueue.state_of(EVICTED).admitted and kueue.state_of(EVICTED).reason == "Preempted"
    )
    assert kueue.release_patch(ADMITTED, STAMP) is None  # nothing to release unless evicted


def test_suspend_deactivates_the_workload_and_resume_activates_it():
    running = {"phase": "Running", "attempt": 0, "failures": 0, "podName": "quickstart-cpu-0", "startTime": STAMP}
    suspended_job = queued_job(running)
    suspended_job["spec"]["suspend"] = True
    live = pod("quickstart-cpu-0", "Running", podIP="127.0.0.5")
    decided = plan(Observed(suspended_job, [live], configmap(JOB), T0, workload=ADMITTED), KUEUE)
    assert decided.status["phase"] == "Suspended" and decided.delete_pods == ["quickstart-cpu-0"]
    assert decided.workload_active is False
    inactive = copy.deepcopy(ADMITTED)
    inactive["spec"]["active"] = False
    again = plan(
        Observed(queued_job(decided.status) | {"spec": suspended_job["spec"]}, [], configmap(JOB), T0, workload=inactive), KUEUE
    )
    assert again.workload_active is None  # already inactive
    resumed = plan(Observed(queued_job(decided.status), [], configmap(JOB), T0, workload=inactive), KUEUE)
    assert resumed.workload_active is True
    assert plan(Observed(queued_job(running), [live], configmap(JOB), T0, workload=ADMITTED), KUEUE).workload_active is None


def test_a_malformed_workload_status_is_read_as_not_admitted_never_a_crash():
    for status in ({"conditions": "Admitted"}, {"conditions": [None, "x", {"type": "Admitted"}]}, {"admission": "cq"}):
        broken = copy.deepcopy(ADMITTED)
        broken["status"] = status
        assert not kueue.state_of(broken).admitted
        decided = plan(Observed(queued_job(), [], None, T0, workload=broken), KUEUE)
        assert decided.create_pod is None and decided.status["phase"] == "Queued"
        assert kueue.finished_patch(broken, True, "", STAMP)["status"]["conditions"][-1]["type"] == "Finished"


def test_a_pod_running_when_its_workload_is_deleted_is_stopped_and_the_job_queued():
    running = {"phase": "Running", "attempt": 0, "failures": 0, "podName": "quickstart-cpu-0", "startTime": STAMP,
               "conditions": [{"type": "Admitted", "status": "True", "reason": "Admitted", "message": "m",
                               "lastTransitionTime": STAMP}]}  # fmt: skip
    live = pod("quickstart-cpu-0", "Running", podIP="127.0.0.5")  # admitted by Kueue; then its Workload was deleted
    decided = plan(Observed(queued_job(running), [live], configmap(JOB), T0), KUEUE)
    assert decided.delete_pods == ["quickstart-cpu-0"] and decided.status["phase"] == "Queued"
    assert decided.status["failures"] == 0 and conditions(decided)["Admitted"] == ("False", "WorkloadMissing")
    queued = plan(Observed(queued_job(decided.status), [], configmap(JOB), T0), KUEUE)
    assert queued.create_workload is not None and queued.create_pod is None


def test_the_queue_label_added_while_the_pod_runs_outside_kueue_is_refused_not_the_pod_deleted():
    running = {"phase": "Running", "attempt": 0, "failures": 0, "podName": "quickstart-cpu-0", "startTime": STAMP}
    live = pod("quickstart-cpu-0", "Running", podIP="127.0.0.5")  # never in Kueue (or Kueue enabled while it ran)
    decided = plan(Observed(queued_job(running), [live], configmap(JOB), T0), KUEUE)
    assert decided.delete_pods == [] and decided.create_workload is None and decided.status["phase"] == "Running"
    refused = next(c for c in decided.status["conditions"] if c["type"] == "SpecChangeRefused")
    assert refused["status"] == "True" and kueue.QUEUE_LABEL in refused["message"] and "added" in refused["message"]
    assert [e[1] for e in decided.events].count("SpecChangeRefused") == 1
    again = plan(Observed(queued_job(decided.status), [live], configmap(JOB), T0), KUEUE)
    assert not any(e[1] == "SpecChangeRefused" for e in again.events)  # once
    gone = plan(Observed(queued_job(again.status | {"attempt": 1}), [], configmap(JOB), T0), KUEUE)  # its next start queues
    assert gone.create_workload is not None and gone.create_pod is None
