"""The real operator process against the API emulator, where the API is involved in a defect:
a job re-created while its pod terminates, transient and permanent refusals of a pod, and the
status recorded before the operator acts. (The planner's side: tests/unit/test_operator_controller.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import yaml

from orbit_runtime.processes import free_port
from tests.kube.emulator import REPO_ROOT, RLJOBS, KubeEmulator
from tests.kube.test_operator import JOB, JOB_PATH, NS, OPERATOR_TOKEN, operator_process, pods, status, wait, wait_for_reconciles


def _owner_uid(pod: dict) -> str:
    return next(r["uid"] for r in pod["metadata"]["ownerReferences"] if r.get("controller"))


def _events(kube: KubeEmulator, reason: str) -> list[dict]:
    return [e for e in kube.events(involved_name=JOB) if e["reason"] == reason]


def test_a_job_recreated_while_its_pod_terminates_runs_its_own_pod(kube: KubeEmulator, tmp_path: Path) -> None:
    """`kubectl delete -f && kubectl apply -f`: the old pod (bound to a node, so its deletion takes its
    grace period) is not the new job's: no progress, no phase from it; the new job runs its own pod."""
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1")) as proc:
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
        wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the first pod")
        kube.bind_pod(NS, f"{JOB}-0")
        kube.set_pod_status(NS, f"{JOB}-0", "Running")
        wait(kube, lambda: status(kube).get("phase") == "Running", "Running")
        old_uid = kube.get(JOB_PATH)["metadata"]["uid"]

        kube.kubectl("delete", "-f", "examples/rljob-cpu.yaml", "--timeout=30s")  # no finalizer: gone at once
        old_pod = kube.get(KubeEmulator.path("v1/pods", NS, f"{JOB}-0"))
        assert old_pod["metadata"]["deletionTimestamp"]  # the garbage collector deletes it; its node takes its time
        kube.set_pod_status(NS, f"{JOB}-0", "Succeeded")  # it even finishes, as the old job's learner
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
        new_uid = wait(kube, lambda: (kube.get(JOB_PATH) or {}).get("metadata", {}).get("uid"), "the new job")
        assert new_uid != old_uid
        wait(kube, lambda: any(c["reason"] == "WaitingForOldObjects" for c in status(kube).get("conditions", [])), "waiting")
        wait_for_reconciles(kube, proc, 3)
        assert status(kube)["phase"] == "Pending" and "progress" not in status(kube) and "Succeeded" != status(kube)["phase"]
        assert [_owner_uid(p) for p in kube.list_pods(NS)] == [old_uid]  # nothing created beside it

        kube.finish_pod_deletion(NS, f"{JOB}-0")
        mine = wait(kube, lambda: next((p for p in kube.list_pods(NS) if _owner_uid(p) == new_uid), None), "the new job's pod")
        configmap = kube.get(KubeEmulator.path("v1/configmaps", NS, f"{JOB}-config"))
        assert _owner_uid(configmap) == new_uid  # its own ConfigMap, not the old one's data under a foreign owner
        kube.set_pod_status(NS, mine["metadata"]["name"], "Succeeded")
        wait(kube, lambda: status(kube).get("phase") == "Succeeded", "the new job Succeeded")
        assert status(kube)["failures"] == 0


def test_transient_refusals_of_a_pod_are_retried_and_a_permanent_one_fails_the_job(kube: KubeEmulator, tmp_path: Path) -> None:
    """429 (API priority and fairness) and a quota 403 are retried, as the Job controller does; a 422 is not."""
    kube.inject_error("create", "pods", 429, "TooManyRequests", "Too many requests, please try again later.", times=2)
    kube.inject_error("create", "pods", 403, "Forbidden", f'pods "{JOB}-0" is forbidden: exceeded quota: compute, requested: '
                      "requests.cpu=3, used: requests.cpu=10, limited: requests.cpu=12")  # fmt: skip
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1")) as proc:
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
        wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the pod, after three refusals", timeout=60)
        assert status(kube)["phase"] == "Pending" and not any(c["type"] == "Failed" for c in status(kube)["conditions"])
        wait(kube, lambda: len(_events(kube, "PodCreateRetrying")) >= 2, "a warning per kind of refusal")
        warned = sorted(e["message"] for e in _events(kube, "PodCreateRetrying"))
        assert len(warned) == 2 and any(": 429 " in m for m in warned) and any("exceeded quota" in m for m in warned), warned
        # (one per kind of refusal, not one per retry)
        scraped = httpx.get(f"http://127.0.0.1:{proc.env['ORBIT_METRICS_PORT']}/metrics").text
        assert 'orbit_operator_api_retries_total{call="create_pod",code="429"} 2.0' in scraped, scraped
        assert 'orbit_operator_api_retries_total{call="create_pod",code="403"} 1.0' in scraped

        kube.kubectl("delete", "-f", "examples/rljob-cpu.yaml", "--timeout=30s")
        kube.inject_error(
            "create", "pods", 422, "Invalid", f'Pod "{JOB}-0" is invalid: spec.tolerations[0].operator: Unsupported value'
        )
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
        wait(kube, lambda: status(kube).get("phase") == "Failed", "Failed for a pod the API server refuses for good")
        failed = next(c for c in status(kube)["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "PodRejected" and "422" in failed["message"] and "tolerations" in failed["message"]


def test_the_status_is_recorded_before_the_pod_is_deleted(kube: KubeEmulator, tmp_path: Path) -> None:
    """Suspend: the bumped attempt is in the status before the DELETE is sent, so an operator that dies
    between the two (here: the DELETE fails) never matches the terminating pod on resume."""
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1")):
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
        wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the first pod")
        kube.set_pod_status(NS, f"{JOB}-0", "Running")
        wait(kube, lambda: status(kube).get("phase") == "Running", "Running")
        fault = kube.inject_error("delete", "pods", 500, "InternalError", "etcdserver: request timed out")
        kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"suspend":true}}')
        wait(kube, lambda: fault.times == 0, "the failed DELETE")
        recorded = status(kube)
        assert recorded["attempt"] == 1 and recorded["phase"] == "Suspended"  # written before the DELETE
        wait(kube, lambda: not pods(kube), "the pod deleted on the next reconcile")
        kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"suspend":false}}')
        wait(kube, lambda: pods(kube).get(f"{JOB}-1"), "a new pod of the next attempt")


def test_a_wiped_status_is_rebuilt_from_the_owned_pods(kube: KubeEmulator, tmp_path: Path) -> None:
    """A status lost (a backup restore, `kubectl edit --subresource=status`) with old failed pods present:
    the job goes on with its running pod; it is not replayed through the old failures to Failed."""
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1")) as proc:
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")  # backoffLimit: 2
        for attempt in range(2):
            wait(kube, lambda a=attempt: pods(kube).get(f"{JOB}-{a}"), f"pod of attempt {attempt}")
            kube.set_pod_status(NS, f"{JOB}-{attempt}", "Failed", exit_code=1)
        wait(kube, lambda: pods(kube).get(f"{JOB}-2"), "pod of attempt 2")
        kube.set_pod_status(NS, f"{JOB}-2", "Running")
        wait(kube, lambda: status(kube).get("phase") == "Running", "Running")
        wiped = {k: None for k in status(kube)}
        kube.patch_status(JOB_PATH, wiped)
        wait(kube, lambda: status(kube).get("phase") == "Running" and status(kube).get("attempt") == 2, "the status rebuilt")
        wait_for_reconciles(kube, proc, 3)
        rebuilt = status(kube)
        assert (
            rebuilt["phase"] == "Running" and rebuilt["failures"] == 2 and sorted(pods(kube)) == [f"{JOB}-{n}" for n in range(3)]
        )
        assert not _events(kube, "Failed")  # never replayed to Failed


def test_no_finalizer_and_reconciles_driven_by_pod_events(kube: KubeEmulator, tmp_path: Path) -> None:
    """With the resync and the learner poll at 10 minutes, only events can move a job: a pod's phase
    reaches the job's status in seconds, and a finished job costs no API requests. Jobs get no
    finalizer (deletion is garbage collection's); one an earlier version put on a job is removed."""
    legacy = yaml.safe_load((REPO_ROOT / "examples" / "rljob-cpu.yaml").read_text())
    legacy["metadata"] = {"name": "legacy", "finalizers": ["orbit.dev/cleanup"]}
    legacy_path = KubeEmulator.path(RLJOBS, NS, "legacy")
    kube.create(KubeEmulator.path(RLJOBS, NS), legacy)
    slow = {"ORBIT_RESYNC_SECONDS": "600", "ORBIT_STATUS_POLL_SECONDS": "600"}
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1"), extra_env=slow):
        wait(kube, lambda: not kube.get(legacy_path)["metadata"].get("finalizers"), "the earlier version's finalizer removed")
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
        wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the first pod", timeout=10)
        assert not kube.get(JOB_PATH)["metadata"].get("finalizers")
        kube.set_pod_status(NS, f"{JOB}-0", "Running")
        wait(kube, lambda: status(kube).get("phase") == "Running", "Running, from the pod event", timeout=5)
        kube.set_pod_status(NS, f"{JOB}-0", "Succeeded")
        wait(kube, lambda: status(kube).get("phase") == "Succeeded", "Succeeded, from the pod event", timeout=5)
        for name in ("legacy-0",):  # the other job's pod finishes too: nothing is left to poll
            kube.set_pod_status(NS, name, "Succeeded")
        wait(kube, lambda: status(kube, legacy_path).get("phase") == "Succeeded", "the legacy job Succeeded", timeout=5)
        time.sleep(1.0)
        before = kube.request_count(OPERATOR_TOKEN)
        time.sleep(3.0)
        assert kube.request_count(OPERATOR_TOKEN) == before  # finished jobs: no polling
        kube.kubectl("delete", "rljob", "legacy", "--timeout=10s")  # never waits for the operator
