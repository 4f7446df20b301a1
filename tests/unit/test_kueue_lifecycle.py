"""Kueue beyond admission (orbit_operator.kueue): PodsReady for waitForPodsReady, the priority Kueue's CEL
requires (checked against the emulator's Workload CRD, which carries Kueue's rules), queue label changes,
re-created Workloads for other requests, a label without Kueue, a pod that succeeded while being evicted, and
the handlers' Workload writes (409, refused creates). No Kueue runs: the tests write its status."""

from __future__ import annotations

import copy
import re

import celpy
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from orbit_operator import handlers, kueue
from orbit_operator.reconcile import Observed, plan
from orbit_operator.settings import OperatorSettings
from orbit_operator.validation import validate_job
from tests.kube.emulator.resources import KUEUE_WORKLOAD_CRD
from tests.unit.test_kueue import ADMITTED, EVICTED, KUEUE, STAMP, conditions, queued_job, workload
from tests.unit.test_operator_reconcile import JOB, T0, configmap, pod

RUNNING = {"phase": "Running", "attempt": 0, "failures": 0, "podName": "quickstart-cpu-0", "startTime": STAMP,
           "conditions": [{"type": "Admitted", "status": "True", "reason": "Admitted", "message": "m", "lastTransitionTime": STAMP}]}  # fmt: skip


def ready_pod(name="quickstart-cpu-0"):
    return pod(name, "Running", podIP="127.0.0.5", conditions=[{"type": "Ready", "status": "True"}])


def with_conditions(wl: dict, **conds: tuple[str, str]) -> dict:
    out = copy.deepcopy(wl)
    for type_, (value, reason) in conds.items():
        out["status"]["conditions"] = [c for c in out["status"]["conditions"] if c["type"] != type_] + [
            {"type": type_, "status": value, "reason": reason, "message": "", "lastTransitionTime": STAMP}
        ]
    return out


def pods_ready(decided) -> tuple[str, str] | None:
    patch = decided.workload_patch
    found = [c for c in (patch or {}).get("status", {}).get("conditions", []) if c["type"] == "PodsReady"]
    return (found[0]["status"], found[0]["reason"]) if patch and found else None


# ---- 1. PodsReady --------------------------------------------------------------------------------------


def test_pods_ready_follows_the_job_s_readiness_only_when_it_changes():
    admitted = plan(
        Observed(queued_job({"phase": "Queued", "attempt": 0, "failures": 0}), [], None, T0, workload=ADMITTED), KUEUE
    )
    assert admitted.create_pod is not None and pods_ready(admitted) == ("False", "WaitForStart")  # at admission
    waiting = with_conditions(ADMITTED, PodsReady=("False", "WaitForStart"))
    starting = plan(
        Observed(queued_job(RUNNING), [pod("quickstart-cpu-0", "Pending")], configmap(JOB), T0, workload=waiting), KUEUE
    )
    assert starting.workload_patch is None  # unchanged: nothing written
    running = plan(Observed(queued_job(RUNNING), [ready_pod()], configmap(JOB), T0, workload=waiting), KUEUE)
    assert pods_ready(running) == ("True", "Started") and running.workload_patch["metadata"]["resourceVersion"] == "7"
    started = with_conditions(ADMITTED, PodsReady=("True", "Started"))
    failed = plan(Observed(queued_job(RUNNING), [pod("quickstart-cpu-0", "Failed")], configmap(JOB), T0, workload=started), KUEUE)
    assert failed.status["attempt"] == 1 and pods_ready(failed) == ("False", "WaitForRecovery")  # a retry
    recovering = with_conditions(ADMITTED, PodsReady=("False", "WaitForRecovery"))
    again = plan(
        Observed(queued_job(failed.status), [ready_pod("quickstart-cpu-1")], configmap(JOB), T0, workload=recovering), KUEUE
    )
    assert pods_ready(again) == ("True", "Recovered")
    assert pods_ready(plan(Observed(queued_job(RUNNING), [ready_pod()], configmap(JOB), T0, workload=started), KUEUE)) is None


def test_a_released_admission_resets_pods_ready():
    evicted = with_conditions(EVICTED, PodsReady=("True", "Started"))
    gone = plan(
        Observed(queued_job({"phase": "Queued", "attempt": 1, "failures": 0}), [], configmap(JOB), T0, workload=evicted), KUEUE
    )
    assert gone.workload_patch["status"]["admission"] is None and pods_ready(gone) == ("False", "WaitForStart")


# ---- 2. the Workload against Kueue's schema and CEL --------------------------------------------------------

CRD = yaml.safe_load(KUEUE_WORKLOAD_CRD.read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
ENV = celpy.Environment()


def refusals(schema: dict, new, old=None, path="") -> list[str]:
    """What the API server would refuse of NEW (OLD: the stored object, for transition rules): the structural
    schema's types, required fields, sizes, patterns and enums, and each level's CEL rules."""
    out = []
    kind = schema.get("type")
    if kind == "object" and not isinstance(new, dict) or kind == "array" and not isinstance(new, list):
        return [f"{path}: not an {kind}"]
    if kind == "string" and not isinstance(new, str) or kind == "integer" and (not isinstance(new, int) or isinstance(new, bool)):
        return [f"{path}: not a {kind}"]
    if kind == "string":
        if "pattern" in schema and not re.search(schema["pattern"], new):
            out.append(f"{path}: does not match {schema['pattern']}")
        if len(new) > schema.get("maxLength", 1 << 30):
            out.append(f"{path}: too long")
    if "enum" in schema and new not in schema["enum"]:
        out.append(f"{path}: not one of {schema['enum']}")
    if kind == "integer" and new < schema.get("minimum", -(1 << 31)):
        out.append(f"{path}: below {schema['minimum']}")
    if kind == "array":
        if not schema.get("minItems", 0) <= len(new) <= schema.get("maxItems", 1 << 30):
            out.append(f"{path}: {len(new)} items")
        out += [r for i, item in enumerate(new) for r in refusals(schema["items"], item, None, f"{path}[{i}]")]
    if kind == "object":
        out += [f"{path}.{name}: required" for name in schema.get("required", []) if name not in new]
        for name, sub in (schema.get("properties") or {}).items():
            if name in new:
                out += refusals(sub, new[name], (old or {}).get(name) if isinstance(old, dict) else None, f"{path}.{name}")
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"] and old is None:
            continue  # a transition rule: only on updates
        activation = {"self": celpy.json_to_cel(new), **({"oldSelf": celpy.json_to_cel(old)} if old is not None else {})}
        if not bool(ENV.program(ENV.compile(rule["rule"])).evaluate(activation)):
            out.append(f"{path or '.'}: {rule['message']}")
    return out


def built(priority_class: str | None = None) -> dict:
    job = queued_job()
    if priority_class:
        job["spec"]["priorityClassName"] = priority_class
    return plan(Observed(job, [], None, T0), KUEUE).create_workload


def test_the_workload_the_operator_creates_passes_kueue_s_schema_and_rules():
    assert refusals(SCHEMA, built()) == []
    with_class = built("rl-high")
    assert refusals(SCHEMA, with_class) == [".spec: priority should not be nil when priorityClassName is set"]
    assert kueue.priority_class_of(with_class) == "rl-high"
    kueue.with_priority(with_class, 1000)  # what the handlers do with the PriorityClass's value
    assert refusals(SCHEMA, with_class) == [] and with_class["spec"]["priority"] == 1000
    assert kueue.priority_class_of(with_class) is None


def test_the_crd_s_rules_refuse_what_real_kueue_refuses():
    good = built()
    assert ".spec.podSets: required" in refusals(SCHEMA, {**good, "spec": {"queueName": "q"}})
    assert ".spec.podSets: 0 items" in refusals(SCHEMA, {**good, "spec": {**good["spec"], "podSets": []}})
    reserved = copy.deepcopy(good) | {"status": {"conditions": [{"type": "QuotaReserved", "status": "True"}]}}
    moved = copy.deepcopy(reserved)
    moved["spec"]["queueName"] = "team-b"
    assert refusals(SCHEMA, moved, reserved) == [".: queueName is immutable while the workload has quota reserved"]
    pending = copy.deepcopy(reserved)
    pending["status"]["conditions"][0]["status"] = "False"
    assert refusals(SCHEMA, moved, pending) == []  # Kueue's QueueNameChange: fine while no quota is reserved


# ---- 3. queue label changes -------------------------------------------------------------------------------


def relabelled(status: dict, queue: str | None) -> dict:
    job = queued_job(status, queue=queue or "x")
    if queue is None:
        del job["metadata"]["labels"][kueue.QUEUE_LABEL]
    return job


def test_once_a_workload_exists_it_decides_the_queue_and_a_new_label_is_patched_while_no_quota_is_reserved():
    pending = workload({"QuotaReserved": ("False", "Pending")})
    queued = plan(
        Observed(relabelled({"phase": "Queued", "attempt": 0, "failures": 0}, "team-b"), [], None, T0, workload=pending), KUEUE
    )
    assert queued.workload_queue == "team-b" and queued.create_pod is None and "team-a" in conditions_message(queued, "Queued")
    running = plan(Observed(relabelled(RUNNING, "team-b"), [ready_pod()], configmap(JOB), T0, workload=ADMITTED), KUEUE)
    assert running.workload_queue is None and running.delete_pods == []  # quota reserved: Kueue refuses the change


def conditions_message(decided, type_: str) -> str:
    return next(c["message"] for c in decided.status["conditions"] if c["type"] == type_)


def test_removing_the_label_while_the_pod_runs_is_refused_and_between_pods_leaves_kueue():
    running = plan(Observed(relabelled(RUNNING, None), [ready_pod()], configmap(JOB), T0, workload=ADMITTED), KUEUE)
    assert running.delete_pods == [] and not running.delete_workload and running.status["phase"] == "Running"
    assert conditions(running)["SpecChangeRefused"] == ("True", "QueueLabelChanged")
    assert kueue.QUEUE_LABEL in conditions_message(running, "SpecChangeRefused")
    evicted = plan(Observed(relabelled(RUNNING, None), [ready_pod()], configmap(JOB), T0, workload=EVICTED), KUEUE)
    assert evicted.delete_pods == ["quickstart-cpu-0"]  # still Kueue's while it runs: its eviction stops the pod
    between = plan(Observed(relabelled(evicted.status, None), [], configmap(JOB), T0, workload=EVICTED), KUEUE)
    assert between.delete_workload and between.create_pod is not None and "Queued" not in conditions(between)


# ---- 4. other pod requests -------------------------------------------------------------------------------


def bigger(status: dict) -> dict:
    job = queued_job(status)
    job["spec"]["restartId"] = "bigger"
    job["spec"]["resources"] = {"learner": {"cpu": "3", "memory": "5Gi"}}
    return job


def test_a_restart_with_other_requests_recreates_the_workload_unless_quota_is_reserved():
    job = bigger({"phase": "Queued", "attempt": 1, "failures": 0, "restartId": "bigger", "reapply": True})
    pending = workload({"QuotaReserved": ("False", "Pending")})
    assert validate_job(job).ok, validate_job(job).errors
    decided = plan(Observed(job, [], configmap(JOB), T0, workload=pending), KUEUE)
    assert decided.delete_workload and decided.create_workload is not None and decided.create_pod is None
    assert kueue.requests_differ(pending, {"spec": decided.create_workload["spec"]["podSets"][0]["template"]["spec"]})
    assert any(e[1] == "WorkloadRecreated" for e in decided.events)
    kept = plan(Observed(job, [], configmap(JOB), T0, workload=ADMITTED), KUEUE)  # quota reserved: runs on the old one
    assert not kept.delete_workload and kept.create_pod is not None
    assert conditions(kept)["WorkloadOutdated"] == ("True", "QuotaReserved")
    same = plan(Observed(queued_job({"phase": "Queued", "attempt": 0, "failures": 0}), [], None, T0, workload=pending), KUEUE)
    assert not same.delete_workload and same.create_workload is None


# ---- 6. the label without Kueue ------------------------------------------------------------------------------


def test_a_queue_label_without_kueue_warns_once_and_runs_outside_kueue():
    decided = plan(Observed(queued_job(), [], None, T0), OperatorSettings())
    assert decided.create_pod is not None and conditions(decided)["Queued"] == ("False", "KueueDisabled")
    assert [e[1] for e in decided.events].count("KueueDisabled") == 1
    again = plan(
        Observed(queued_job(decided.status), [pod("quickstart-cpu-0", "Pending")], configmap(JOB), T0), OperatorSettings()
    )
    assert not any(e[1] == "KueueDisabled" for e in again.events)
    assert not any(e[1] == "KueueDisabled" for e in plan(Observed(copy.deepcopy(JOB), [], None, T0), OperatorSettings()).events)


# ---- 7. a pod that succeeded in its grace period ------------------------------------------------------------


def test_a_pod_that_succeeded_while_being_evicted_completes_the_job():
    evicted = plan(Observed(queued_job(RUNNING), [ready_pod()], configmap(JOB), T0, workload=EVICTED), KUEUE)
    assert evicted.status["attempt"] == 1 and evicted.delete_pods == ["quickstart-cpu-0"]
    finished = pod("quickstart-cpu-0", "Succeeded")
    finished["metadata"]["deletionTimestamp"] = STAMP
    done = plan(Observed(queued_job(evicted.status), [finished], configmap(JOB), T0, workload=EVICTED), KUEUE)
    assert done.status["phase"] == "Succeeded" and conditions(done)["Complete"] == ("True", "LearnerSucceeded")
    assert done.create_pod is None and done.create_workload is None
    assert {c["type"]: c["reason"] for c in done.workload_patch["status"]["conditions"]}["Finished"] == "Succeeded"


# ---- 8. the handlers' Workload writes -------------------------------------------------------------------------


class FakeKube:
    def __init__(self, patch_error: int | None = None, create_error: int | None = None, priorities: dict | None = None):
        self.patch_error, self.create_error, self.priorities = patch_error, create_error, priorities or {}
        self.created, self.patched = [], []

    def patch_workload_status(self, namespace, name, patch):
        if self.patch_error:
            raise ApiException(status=self.patch_error, reason="Conflict")
        self.patched.append(patch)

    def priority_class_value(self, name):
        return self.priorities.get(name)

    def create_workload(self, body):
        if self.create_error:
            raise ApiException(status=self.create_error, reason="Invalid")
        self.created.append(body)
        return True

    def secret(self, namespace, name):
        return None


def test_a_workload_status_patch_that_conflicts_is_left_to_the_next_reconcile():
    patch = kueue.finished_patch(ADMITTED, True, "done", STAMP)
    handlers._patch_workload(FakeKube(patch_error=409), "default", "wl", patch)  # no exception: Kueue wrote since
    with pytest.raises(ApiException):
        handlers._patch_workload(FakeKube(patch_error=500), "default", "wl", patch)
    ok = FakeKube()
    handlers._patch_workload(ok, "default", "wl", patch)
    assert ok.patched == [patch]


@pytest.mark.parametrize("priorities, error, expect", [({"rl-high": 1000}, None, None), ({}, None, "does not exist"),
                                                       ({"rl-high": 5}, 422, "422")])  # fmt: skip
def test_the_workload_gets_the_priority_class_value_and_a_refusal_is_a_condition_posted_once(priorities, error, expect):
    job = queued_job()
    job["spec"]["priorityClassName"] = "rl-high"
    job["metadata"]["uid"], job["metadata"]["generation"] = "u-1", 1
    decided = plan(Observed(job, [], None, T0), KUEUE)
    api = FakeKube(create_error=error, priorities=priorities)
    handlers._refusals.clear()
    event = handlers._create_workload(api, job, decided)
    if expect is None:
        assert event is None and api.created[0]["spec"]["priority"] == 1000
        return
    assert expect in event and not api.created and decided.requeue_after is not None
    assert conditions(decided)["Queued"] == ("True", "WorkloadRejected") and expect in conditions_message(decided, "Queued")
    assert handlers._create_workload(api, job, plan(Observed(job, [], None, T0), KUEUE)) is None  # the event once


# ---- 5. the chart: Kueue's ServiceAccount reads RLTrainingJobs; the operator reads PriorityClasses -------------


def test_with_kueue_the_chart_lets_kueue_read_rltrainingjobs_and_the_operator_read_priority_classes():
    from tests.unit.test_chart import by_kind, render

    assert not [o for o in render(None) if "kueue" in o["metadata"]["name"] or "priorityclasses" in o["metadata"]["name"]]
    for values, (sa, ns) in (({"kueue": {"enabled": True}}, ("kueue-controller-manager", "kueue-system")),
                             ({"kueue": {"enabled": True, "serviceAccount": {"name": "kq", "namespace": "q"}},
                               "watchNamespaces": ["default"]}, ("kq", "q"))):  # fmt: skip
        objects = render(values)
        roles = {o["metadata"]["name"]: o for o in by_kind(objects, "ClusterRole")}
        bindings = {o["metadata"]["name"]: o for o in by_kind(objects, "ClusterRoleBinding")}
        assert roles["orbit-kueue-rltrainingjobs"]["rules"] == [
            {"apiGroups": ["orbit.dev"], "resources": ["rltrainingjobs"], "verbs": ["get", "list", "watch"]}
        ]
        assert bindings["orbit-kueue-rltrainingjobs"]["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
        assert bindings["orbit-kueue-rltrainingjobs"]["roleRef"]["name"] == "orbit-kueue-rltrainingjobs"
        assert roles["orbit-operator-priorityclasses"]["rules"] == [
            {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"], "verbs": ["get"]}
        ]
        (subject,) = bindings["orbit-operator-priorityclasses"]["subjects"]
        assert (
            subject["namespace"] == "orbit-system"
            and subject["name"] == by_kind(objects, "ServiceAccount")[0]["metadata"]["name"]
        )
