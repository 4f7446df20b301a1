"""Kueue, end to end: the real operator process (ORBIT_KUEUE=true) against the API emulator serving Kueue's
Workload kind. No Kueue controller runs: the test plays Kueue, writing the Workload's admission and
conditions through the API as Kueue's scheduler would (QuotaReserved, Admitted, Evicted), and checks the
operator keeps the job-framework contract: one Workload per job, no pod before admission, eviction
stops the pod without counting a failure and releases the admission, re-admission resumes, a finished
job finishes its Workload."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from orbit_runtime.processes import free_port
from tests.kube.emulator import REPO_ROOT, KubeEmulator
from tests.kube.emulator.resources import KUEUE_WORKLOAD_CRD
from tests.kube.test_operator import JOB, NS, operator_process, pods, status, wait, wait_for_reconciles

WORKLOADS = "kueue.x-k8s.io/v1beta1/workloads"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_ON = {"ORBIT_KUEUE": "true"}
EVENTS_ONLY = {**KUEUE_ON, "ORBIT_RESYNC_SECONDS": "600"}  # no resync to fall back on: Workload events drive the reconciles
STAMP = "2026-12-01T00:00:00Z"


def _apply_queued_job(kube: KubeEmulator, tmp_path: Path, queue: str | None = "team-a") -> None:
    job = yaml.safe_load((REPO_ROOT / "examples" / "rljob-cpu.yaml").read_text())
    if queue is not None:
        job["metadata"]["labels"] = {QUEUE_LABEL: queue}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    kube.kubectl("apply", "--validate=false", "-f", str(path))


def _workloads(kube: KubeEmulator) -> list[dict]:
    return kube.list(KubeEmulator.path(WORKLOADS, NS))


def _conditions(obj: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in (obj.get("status") or {}).get("conditions") or []}


def _when(obj: dict, predicate) -> dict | None:
    """OBJ if PREDICATE holds for its conditions (type -> (status, reason)), else None (wait on)."""
    return obj if predicate(_conditions(obj)) else None


def _kueue_writes(kube: KubeEmulator, name: str, conditions: dict[str, tuple[str, str]], admission: dict | None) -> None:
    """What Kueue's scheduler writes: the Workload's conditions (type -> (status, reason)) and its admission."""
    path = KubeEmulator.path(WORKLOADS, NS, name)
    current = {c["type"]: c for c in kube.get(path).get("status", {}).get("conditions") or []}
    for type_, (value, reason) in conditions.items():
        current[type_] = {
            "type": type_,
            "status": value,
            "reason": reason,
            "message": f"{type_}: {reason}",
            "lastTransitionTime": STAMP,
        }
    kube.patch_status(path, {"conditions": list(current.values()), "admission": admission})


ADMISSION = {"clusterQueue": "cq-cpu", "podSetAssignments": [{"name": "main", "flavors": {"cpu": "default"}, "count": 1}]}
ADMIT = {"QuotaReserved": ("True", "QuotaReserved"), "Admitted": ("True", "Admitted"), "Evicted": ("False", "QuotaReserved")}


def test_kueue_admits_the_job_as_one_workload_and_preemption_resumes_it_without_a_failure(
    kube: KubeEmulator, tmp_path: Path
) -> None:
    kube.load_crd(KUEUE_WORKLOAD_CRD)
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1"), extra_env=KUEUE_ON) as proc:
        _apply_queued_job(kube, tmp_path)
        # (1) suspended first: a Workload, no pod, the job Queued
        (workload,) = wait(kube, lambda: _workloads(kube), "the job's Workload")
        name = workload["metadata"]["name"]
        uid = kube.get(KubeEmulator.path("orbit.dev/v1alpha1/rltrainingjobs", NS, JOB))["metadata"]["uid"]
        assert name.startswith(f"rltrainingjob-{JOB}-") and workload["metadata"]["labels"]["kueue.x-k8s.io/job-uid"] == uid
        assert [(r["kind"], r["uid"], r["controller"]) for r in workload["metadata"]["ownerReferences"]] == [
            ("RLTrainingJob", uid, True)
        ]
        assert workload["spec"]["queueName"] == "team-a"
        (pod_set,) = workload["spec"]["podSets"]
        assert pod_set["name"] == "main" and pod_set["count"] == 1
        assert [c["name"] for c in pod_set["template"]["spec"]["containers"]] == ["learner"]
        wait(kube, lambda: status(kube).get("phase") == "Queued", "phase Queued")
        assert _conditions(kube.get(KubeEmulator.path("orbit.dev/v1alpha1/rltrainingjobs", NS, JOB)))["Queued"] == (
            "True", "WaitingForAdmission")  # fmt: skip
        wait_for_reconciles(kube, proc, 3)
        assert not pods(kube) and len(_workloads(kube)) == 1  # one Workload, however many reconciles

        # (2) Kueue admits it: the pod is created
        _kueue_writes(kube, name, ADMIT, ADMISSION)
        first = wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the pod, once admitted")
        assert QUEUE_LABEL not in first["metadata"]["labels"]  # not a second workload for Kueue's pod integration
        assert _conditions({"status": status(kube)})["Admitted"] == ("True", "Admitted")
        kube.bind_pod(NS, f"{JOB}-0")  # on a node: its deletion waits for its learner (the checkpoint on SIGTERM)
        kube.set_pod_status(NS, f"{JOB}-0", "Running")
        wait(kube, lambda: status(kube).get("phase") == "Running", "Running")

        # (3) preempted: the pod is deleted, no failure counted, the job Queued again
        _kueue_writes(kube, name, {"Evicted": ("True", "Preempted"), "Preempted": ("True", "InClusterQueue")}, ADMISSION)
        wait(kube, lambda: not pods(kube), "the pod deleted (terminating)")
        wait(kube, lambda: status(kube).get("phase") == "Queued", "Queued again")
        evicted = status(kube)
        assert evicted["failures"] == 0 and evicted["attempt"] == 1
        assert _conditions({"status": evicted})["Admitted"] == ("False", "Preempted")
        path = KubeEmulator.path(WORKLOADS, NS, name)
        wait_for_reconciles(kube, proc, 2)
        assert _conditions(kube.get(path))["QuotaReserved"] == ("True", "QuotaReserved")  # its pod still checkpoints
        kube.finish_pod_deletion(NS, f"{JOB}-0")  # the learner exited
        released = wait(kube, lambda: _when(kube.get(path), lambda c: c["QuotaReserved"][0] == "False"), "the admission released")
        assert "admission" not in released["status"] and _conditions(released)["Requeued"] == ("True", "Preempted")
        assert _conditions(released)["Admitted"] == ("False", "NoReservation")
        wait_for_reconciles(kube, proc, 2)
        assert not kube.list_pods(NS)  # not before Kueue admits it again

        # (4) admitted again: a new pod (the learner resumes from its last checkpoint), still no failure
        _kueue_writes(kube, name, ADMIT, ADMISSION)
        wait(kube, lambda: pods(kube).get(f"{JOB}-1"), "a new pod, once admitted again")
        kube.set_pod_status(NS, f"{JOB}-1", "Succeeded")
        # (6) finished: the Workload too
        wait(kube, lambda: status(kube).get("phase") == "Succeeded", "Succeeded")
        assert status(kube)["failures"] == 0
        finished = wait(kube, lambda: _when(kube.get(path), lambda c: "Finished" in c), "the Workload Finished")
        assert _conditions(finished)["Finished"] == ("True", "Succeeded")
        reasons = [e["reason"] for e in kube.events(involved_name=JOB)]
        assert "Queued" in reasons and "Admitted" in reasons and "Evicted" in reasons
        scraped = httpx.get(f"http://127.0.0.1:{proc.env['ORBIT_METRICS_PORT']}/metrics").text
        assert "orbit_operator_kueue_evictions_total 1.0" in scraped and "orbit_operator_kueue_workloads_total 1.0" in scraped
        assert 'orbit_operator_kueue_workload_updates_total{kind="released"} 1.0' in scraped
        assert len(_workloads(kube)) == 1


def test_with_kueue_enabled_a_job_without_a_queue_name_runs_without_a_workload(kube: KubeEmulator, tmp_path: Path) -> None:
    kube.load_crd(KUEUE_WORKLOAD_CRD)
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1"), extra_env=KUEUE_ON) as proc:
        _apply_queued_job(kube, tmp_path, queue=None)
        wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the pod, at once")
        wait_for_reconciles(kube, proc, 2)
        assert not _workloads(kube) and status(kube)["phase"] == "Pending"
        assert not {"Queued", "Admitted"} & set(_conditions({"status": status(kube)}))


def test_a_suspended_job_deactivates_its_workload_and_frees_its_quota(kube: KubeEmulator, tmp_path: Path) -> None:
    """Also: with no resync, Kueue's writes reach the job through the operator's watch of Workloads."""
    kube.load_crd(KUEUE_WORKLOAD_CRD)
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1"), extra_env=EVENTS_ONLY):
        _apply_queued_job(kube, tmp_path)
        (workload,) = wait(kube, lambda: _workloads(kube), "the job's Workload")
        path = KubeEmulator.path(WORKLOADS, NS, workload["metadata"]["name"])
        _kueue_writes(kube, workload["metadata"]["name"], ADMIT, ADMISSION)
        wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the pod, once admitted")
        kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"suspend":true}}')
        wait(kube, lambda: kube.get(path)["spec"].get("active") is False, "the Workload deactivated")
        assert status(kube)["phase"] == "Suspended" and not pods(kube)
        # Kueue evicts a deactivated Workload; the operator releases its quota (the pod is gone)
        _kueue_writes(kube, workload["metadata"]["name"], {"Evicted": ("True", "Deactivated")}, ADMISSION)
        released = wait(kube, lambda: _when(kube.get(path), lambda c: c["QuotaReserved"][0] == "False"), "the quota released")
        assert _conditions(released)["Requeued"] == ("False", "Deactivated") and "admission" not in released["status"]

        kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"suspend":false}}')
        wait(kube, lambda: kube.get(path)["spec"].get("active") is True, "the Workload active again")
        wait(kube, lambda: status(kube).get("phase") == "Queued", "Queued until admitted again")
        assert not pods(kube)
        _kueue_writes(kube, workload["metadata"]["name"], ADMIT, ADMISSION)
        wait(kube, lambda: pods(kube).get(f"{JOB}-1"), "a new pod, once admitted again")
        assert status(kube)["failures"] == 0


def test_priority_pods_ready_and_queue_label_changes_reach_the_workload(kube: KubeEmulator, tmp_path: Path) -> None:
    """The PriorityClass's value becomes the Workload's priority (Kueue's CEL requires it with a class); PodsReady
    follows the pod; a new queue label is patched in while no quota is reserved; removing the label is refused while
    the pod runs, and between pods deletes the Workload (the next pod runs outside Kueue)."""
    kube.load_crd(KUEUE_WORKLOAD_CRD)
    priority = tmp_path / "priority.yaml"
    priority.write_text(yaml.safe_dump({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                        "metadata": {"name": "rl-high"}, "value": 1000}))  # fmt: skip
    kube.kubectl("apply", "--validate=false", "-f", str(priority))
    job = yaml.safe_load((REPO_ROOT / "examples" / "rljob-cpu.yaml").read_text())
    job["metadata"]["labels"] = {QUEUE_LABEL: "team-a"}
    job["spec"]["priorityClassName"] = "rl-high"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1"), extra_env=KUEUE_ON):
        kube.kubectl("apply", "--validate=false", "-f", str(tmp_path / "job.yaml"))
        (workload,) = wait(kube, lambda: _workloads(kube), "the job's Workload")
        assert workload["spec"]["priority"] == 1000 and workload["spec"]["priorityClassName"] == "rl-high"
        path = KubeEmulator.path(WORKLOADS, NS, workload["metadata"]["name"])
        kube.kubectl("label", "rljob", JOB, f"{QUEUE_LABEL}=team-b", "--overwrite")
        wait(kube, lambda: kube.get(path)["spec"]["queueName"] == "team-b", "the new queue in the Workload")

        _kueue_writes(kube, workload["metadata"]["name"], ADMIT, ADMISSION)
        wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the pod, once admitted")
        wait(kube, lambda: _when(kube.get(path), lambda c: c.get("PodsReady") == ("False", "WaitForStart")), "PodsReady False")
        kube.set_pod_status(NS, f"{JOB}-0", "Running")
        wait(kube, lambda: _when(kube.get(path), lambda c: c.get("PodsReady") == ("True", "Started")), "PodsReady True")

        kube.kubectl("label", "rljob", JOB, f"{QUEUE_LABEL}-")
        wait(kube, lambda: _conditions({"status": status(kube)}).get("SpecChangeRefused") == ("True", "QueueLabelChanged"),
             "the label's removal refused")  # fmt: skip
        assert pods(kube).get(f"{JOB}-0") is not None and _workloads(kube)
        kube.set_pod_status(NS, f"{JOB}-0", "Failed", exit_code=1)
        wait(kube, lambda: not _workloads(kube), "the Workload deleted between pods")
        wait(kube, lambda: pods(kube).get(f"{JOB}-1"), "the next pod, outside Kueue", timeout=60.0)
        reasons = [e["reason"] for e in kube.events(involved_name=JOB)]
        assert "SpecChangeRefused" in reasons and "LeftKueue" in reasons
