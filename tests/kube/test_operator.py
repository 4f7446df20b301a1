"""The real operator process (`python -m orbit_operator`) against the API emulator, driven with
real `kubectl apply -f`. The emulator plays the kubelet (tests set pod phases); pods do not
run here (tests/e2e runs them). Mocked because nothing else can run here: the cluster."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client import CollectorRegistry

from orbit_runtime.observability.server import MetricsServer
from orbit_runtime.processes import free_port
from orbit_runtime.trainer.recorder import RunState, status_document
from tests.kube.emulator import REPO_ROOT, RLJOBS, KubeEmulator
from tests.unit.test_operator_manifests import BAD_JOBS

NS = "default"
JOB = "quickstart-cpu"
OPERATOR_TOKEN = "orbit-operator"  # the operator's kubeconfig token: its API calls are recorded apart from the tests'
# (verb, group, resource, subresource, scope) of every operator run, by mode: "cluster-wide", "namespaced" or "kueue"
# (cluster-wide with ORBIT_KUEUE=true: tests/kube/test_kueue.py)
OPERATOR_API_CALLS: dict[str, set[tuple[str, str, str, str, str]]] = {"cluster-wide": set(), "namespaced": set(), "kueue": set(),
                                                                      "network-policy": set()}  # fmt: skip
RECORDED_TESTS: set[str] = set()  # names of the tests whose operator runs OPERATOR_API_CALLS holds
JOB_PATH = KubeEmulator.path(RLJOBS, NS, JOB)


@contextlib.contextmanager
def operator_process(kube: KubeEmulator, log_path: Path, status_port: int, extra_env: dict[str, str] | None = None):
    """`python -m orbit_operator` (the operator image's entrypoint), with short test intervals."""
    kubeconfig = kube.write_kubeconfig(log_path.parent / "operator-kubeconfig", token=OPERATOR_TOKEN, default=False)
    env = {**kube.env(kubeconfig), "PYTHONUNBUFFERED": "1", "ORBIT_STATUS_POLL_SECONDS": "0.5", "ORBIT_BACKOFF_BASE_SECONDS": "1",
           "ORBIT_RESYNC_SECONDS": "2",
           "ORBIT_LEARNER_STATUS_PORT": str(status_port), "ORBIT_LIVENESS_PORT": str(free_port("127.0.0.1")),
           "ORBIT_METRICS_PORT": str(free_port("127.0.0.1")), "ORBIT_BIND_ADDRESS": "127.0.0.1",
           "ORBIT_CACHE_ROOT": "/var/lib/orbit-test/bases", **(extra_env or {})}  # fmt: skip
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "orbit_operator"], env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        proc.env = env  # type: ignore[attr-defined]
        try:
            yield proc
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- operator log ---\n{log_path.read_text()[-4000:]}") from exc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            mode = ("namespaced" if env.get("ORBIT_NAMESPACES") else "kueue" if env.get("ORBIT_KUEUE") == "true"
                    else "network-policy" if env.get("ORBIT_NETWORK_POLICY") == "true" else "cluster-wide")  # fmt: skip
            OPERATOR_API_CALLS[mode].update(kube.api_calls(OPERATOR_TOKEN))
            RECORDED_TESTS.add(_current_test())


def _current_test() -> str:
    """The running test function's name (pytest sets PYTEST_CURRENT_TEST to "path::name[id] (phase)")."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].split("::")[-1].split("[")[0]


def reconciles(proc) -> float:
    """The operator's count of reconciles so far (all outcomes), from its /metrics."""
    text = httpx.get(f"http://127.0.0.1:{proc.env['ORBIT_METRICS_PORT']}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("orbit_operator_reconciles_total{"))


def wait_for_reconciles(kube: KubeEmulator, proc, count: int) -> None:
    """Block until the operator has reconciled COUNT more times: a negative check ("no new pod")
    then rests on reconciles that happened, not on a sleep that may have been too short."""
    start = _wait_metrics(proc)
    wait(kube, lambda: reconciles(proc) >= start + count, f"{count} more reconciles")


def _wait_metrics(proc) -> float:
    deadline = time.monotonic() + 30
    while True:
        try:
            return reconciles(proc)
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def status(kube: KubeEmulator, path: str = JOB_PATH) -> dict:
    return (kube.get(path) or {}).get("status") or {}


def pods(kube: KubeEmulator) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in kube.list_pods(NS) if not p["metadata"].get("deletionTimestamp")}


def wait(kube: KubeEmulator, predicate, message: str, timeout: float = 30.0):
    return kube.wait_for(predicate, timeout=timeout, interval=0.2, message=message)


def test_job_lifecycle_pod_status_progress_backoff_suspend_success_and_delete(kube: KubeEmulator, tmp_path: Path) -> None:
    status_port = free_port("127.0.0.1")
    # the learner's /status endpoint (its server and document code), at the pod IP the "kubelet" reports; the
    # run state is a learner's after 3 steps (a real run serves it in tests/e2e/test_rljob.py)
    state = RunState(step=3, adapter_version=3, rows=[{"kind": "eval", "step": 2, "accuracy": 0.25},
                                                       {"kind": "step", "step": 3, "reward_mean": 0.5}])  # fmt: skip

    def learner() -> dict:
        return status_document(state, phase="running", max_steps=4, checkpoint_uri="s3://orbit-test/quickstart-cpu",
                               last_checkpoint_step=2, restarts={"rollout": 0, "reference": 0})  # fmt: skip

    server = MetricsServer(CollectorRegistry(), "127.0.0.7", status_port, status=learner)
    server.start()
    try:
        with operator_process(kube, tmp_path / "operator.log", status_port) as proc:
            assert "created" in kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml").stdout
            pod = wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the first pod")
            spec = pod["spec"]
            assert [c["name"] for c in spec["initContainers"]] == ["prepare-base", "rollout"]  # reference.mode: shared
            assert [c["name"] for c in spec["containers"]] == ["learner"]
            assert {v["name"]: v for v in spec["volumes"]}["base-cache"]["hostPath"]["path"] == "/var/lib/orbit-test/bases"
            assert pod["metadata"]["ownerReferences"][0]["kind"] == "RLTrainingJob"
            configmap = kube.get(KubeEmulator.path("v1/configmaps", NS, f"{JOB}-config"))
            assert yaml.safe_load(configmap["data"]["job.yaml"])["model"]["path"] == "/base"
            wait(kube, lambda: status(kube).get("phase") == "Pending", "phase Pending")
            wait(kube, lambda: any(e["reason"] == "PodCreated" for e in kube.events(involved_name=JOB)), "a PodCreated event")

            kube.set_pod_status(NS, f"{JOB}-0", "Running", pod_ip="127.0.0.7")
            wait(kube, lambda: status(kube).get("progress", {}).get("step") == 3, "progress from the learner's /status")
            current = status(kube)
            assert current["phase"] == "Running" and current["progress"]["stepText"] == "3/4"
            assert current["progress"]["lastCheckpoint"]["step"] == 2 and current["observedGeneration"] == 1
            ready = [c for c in current["conditions"] if c["type"] == "Ready"][0]
            assert ready["status"] == "True" and ready["lastTransitionTime"]
            table = kube.kubectl("get", "rljob", JOB).stdout
            assert "Running" in table and "3/4" in table and "0.5" in table and "0.25" in table

            # a change the running pod cannot take is refused, naming the field; the pod keeps its spec
            kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"rollout":{"max_tokens":64}}}')
            refused = wait(kube, lambda: [c for c in status(kube).get("conditions", []) if c["type"] == "SpecChangeRefused"],
                           "SpecChangeRefused")  # fmt: skip
            assert "rollout.max_tokens: 12 (running) -> 64 (spec)" in refused[0]["message"]
            assert list(pods(kube)) == [f"{JOB}-0"] and status(kube)["observedGeneration"] == 1  # generation 2 was refused
            kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"rollout":{"max_tokens":12}}}')
            wait(kube, lambda: not any(c["type"] == "SpecChangeRefused" for c in status(kube)["conditions"]), "the refusal cleared")

            kube.set_pod_status(NS, f"{JOB}-0", "Failed", exit_code=1, reason="Error")  # the learner crashed
            wait(kube, lambda: status(kube).get("failures") == 1, "failures counted")
            assert f"{JOB}-1" not in pods(kube)  # backoff first
            wait(kube, lambda: f"{JOB}-1" in pods(kube), "a new pod after the backoff")
            wait(kube, lambda: any(e["reason"] == "PodFailed" and "learner: Error (exit 1)" in e["message"]
                                   for e in kube.events(involved_name=JOB)), "a PodFailed event naming the container")  # fmt: skip

            kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"suspend":true}}')
            wait(kube, lambda: status(kube).get("phase") == "Suspended" and not pods(kube).get(f"{JOB}-1"), "suspended, pod gone")
            assert status(kube)["progress"]["step"] == 3  # the status is kept
            kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"suspend":false}}')
            resumed = wait(kube, lambda: pods(kube).get(f"{JOB}-2"), "a new pod on resume")
            kube.set_pod_status(NS, resumed["metadata"]["name"], "Succeeded")
            wait(kube, lambda: status(kube).get("phase") == "Succeeded", "Succeeded")
            assert status(kube)["completionTime"] and status(kube)["failures"] == 1
            for phase in ("Pending", "Running", "Suspended", "Succeeded"):  # an Event on every transition
                wait(kube, lambda p=phase: any(e["reason"] == p for e in kube.events(involved_name=JOB)), f"a {phase} event")

            operator_metrics = httpx.get(f"http://127.0.0.1:{proc.env['ORBIT_METRICS_PORT']}/metrics").text
            assert 'orbit_operator_reconciles_total{outcome="ok"}' in operator_metrics
            assert 'orbit_operator_jobs{phase="Succeeded"} 1.0' in operator_metrics
            assert httpx.get(f"http://127.0.0.1:{proc.env['ORBIT_LIVENESS_PORT']}/healthz").status_code == 200

            kube.kubectl("delete", "rljob", JOB, "--timeout=30s")
            assert kube.get(JOB_PATH) is None
            assert not kube.list_pods(NS) and kube.get(KubeEmulator.path("v1/configmaps", NS, f"{JOB}-config")) is None
    finally:
        server.stop()


def test_backoff_limit_exhausted_fails_the_job(kube: KubeEmulator, tmp_path: Path) -> None:
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1")) as proc:
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")  # backoffLimit: 2
        for attempt in range(3):
            wait(kube, lambda a=attempt: pods(kube).get(f"{JOB}-{a}"), f"pod of attempt {attempt}")
            kube.set_pod_status(NS, f"{JOB}-{attempt}", "Failed", exit_code=1)
        wait(kube, lambda: status(kube).get("phase") == "Failed", "Failed after the backoff limit")
        failed = [c for c in status(kube)["conditions"] if c["type"] == "Failed"][0]
        assert failed["reason"] == "BackoffLimitExceeded" and status(kube)["failures"] == 3
        wait_for_reconciles(kube, proc, 3)
        assert f"{JOB}-3" not in pods(kube)  # no more pods
        kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"ttlSecondsAfterFinished":1}}')
        wait(kube, lambda: kube.get(JOB_PATH) is None, "the finished job deleted after its TTL")


def test_an_operator_killed_mid_reconcile_creates_no_duplicate_pod(kube: KubeEmulator, tmp_path: Path) -> None:
    status_port = free_port("127.0.0.1")
    log = tmp_path / "operator.log"
    kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
    # the operator dies right after creating the pod, before the status records it (the worst moment)
    with operator_process(kube, log, status_port, extra_env={"ORBIT_FAULT_EXIT_AFTER_POD_CREATE": "1"}) as proc:
        assert proc.wait(30) == 70
    assert list(pods(kube)) == [f"{JOB}-0"] and "podName" not in status(kube)
    with operator_process(kube, log, status_port) as proc:
        wait(kube, lambda: status(kube).get("phase") == "Pending" and status(kube).get("podName") == f"{JOB}-0", "status after restart")
        wait_for_reconciles(kube, proc, 3)
        assert list(pods(kube)) == [f"{JOB}-0"]  # adopted, not duplicated
        created = [e for e in kube.events(involved_name=JOB) if e["reason"] == "PodCreated"]
        assert len(created) <= 1  # the adopted pod is not announced again


def test_bad_jobs_fail_invalid_naming_the_field_while_a_good_job_proceeds(kube: KubeEmulator, tmp_path: Path) -> None:
    documents, expected = [], {}
    for index, (case, (manifest, field)) in enumerate(sorted(BAD_JOBS.items())):
        if manifest.get("kind") != "RLTrainingJob" or manifest.get("apiVersion") != "orbit.dev/v1alpha1":
            continue  # not an RLTrainingJob: the API server refuses it, the operator never sees it
        if not isinstance(manifest.get("metadata"), dict) or manifest["metadata"].get("name") != JOB:
            continue  # an invalid object name: the API server refuses it
        bad = copy.deepcopy(manifest)
        bad["metadata"] = {"name": f"bad-{index}"}
        documents.append(bad)
        expected[f"bad-{index}"] = (case, field)
    assert len(expected) >= 30
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all([yaml.safe_load((REPO_ROOT / "examples" / "rljob-cpu.yaml").read_text()), *documents]))
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1")) as proc:
        kube.kubectl("apply", "--validate=false", "-f", str(path))
        for name, (case, field) in expected.items():
            job = KubeEmulator.path(RLJOBS, NS, name)
            wait(kube, lambda j=job: status(kube, j).get("phase") == "Failed", f"{case}: Failed")
            invalid = [c for c in status(kube, job)["conditions"] if c["type"] == "Invalid"]
            assert invalid and field in invalid[0]["message"], (case, invalid)
            wait(kube, lambda n=name: any(e["type"] == "Warning" and e["reason"] == "Invalid" for e in kube.events(involved_name=n)),
                 f"{case}: a Warning event")  # kopf posts events asynchronously  # fmt: skip
        assert not any(p["metadata"]["name"].startswith("bad-") for p in kube.list_pods(NS))
        wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the good job's pod")
        assert proc.poll() is None  # still running
        result = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "validate", str(path)], capture_output=True, text=True,
                                cwd=REPO_ROOT, env={**os.environ})  # fmt: skip
        assert result.returncode == 1 and result.stderr.count("): invalid") == len(expected)


def test_an_operator_watching_listed_namespaces_runs_only_their_jobs(kube: KubeEmulator, tmp_path: Path) -> None:
    """ORBIT_NAMESPACES (the chart's watchNamespaces): jobs elsewhere are not touched; the whole
    lifecycle works with namespace-scoped calls only (tests/kube/test_rbac.py checks them against
    the chart's Roles)."""
    kube.create(KubeEmulator.path("v1/namespaces"), {"metadata": {"name": "other"}})
    kube.kubectl("apply", "--validate=false", "-n", "other", "-f", "examples/rljob-cpu.yaml")
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1"), extra_env={"ORBIT_NAMESPACES": NS}):
        kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
        wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the first pod")
        kube.set_pod_status(NS, f"{JOB}-0", "Running", pod_ip="127.0.0.9")
        wait(kube, lambda: status(kube).get("phase") == "Running", "Running")
        kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"suspend":true}}')
        wait(kube, lambda: status(kube).get("phase") == "Suspended" and not pods(kube), "suspended, pod deleted")
        # resumed with a changed spec: the ConfigMap is rewritten (patched) and a new pod created from it
        kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"suspend":false,"rollout":{"max_tokens":16}}}')
        resumed = wait(kube, lambda: next(iter(pods(kube).values()), None), "a new pod")
        config = kube.get(KubeEmulator.path("v1/configmaps", NS, f"{JOB}-config"))
        assert yaml.safe_load(config["data"]["job.yaml"])["rollout"]["max_tokens"] == 16
        kube.set_pod_status(NS, resumed["metadata"]["name"], "Succeeded")
        wait(kube, lambda: status(kube).get("phase") == "Succeeded", "Succeeded")
        kube.kubectl("patch", "rljob", JOB, "--type=merge", "-p", '{"spec":{"ttlSecondsAfterFinished":1}}')
        wait(kube, lambda: kube.get(JOB_PATH) is None, "deleted after its TTL")
        wait(kube, lambda: kube.get(KubeEmulator.path("v1/configmaps", NS, f"{JOB}-config")) is None, "its ConfigMap removed")
        other = kube.get(KubeEmulator.path(RLJOBS, "other", JOB))
        assert "status" not in other and not kube.list_pods("other")  # not watched: untouched
    assert not [c for c in kube.api_calls(OPERATOR_TOKEN) if c[-1] == "cluster"]  # nothing cluster-wide (scanning off)


def test_a_job_that_cannot_fit_its_node_is_refused_with_the_breakdown_and_starts_once_fixed(kube: KubeEmulator, tmp_path: Path) -> None:
    """Admission: the job names its architecture (base.architecture) and its GPUs (the nodeSelector's
    product): the operator plans it before any pod exists. DeepSeek-V3 with today's one-device learner
    does not fit an H200; edited to a model that fits, it starts, and its status says how it fits."""
    job = yaml.safe_load((REPO_ROOT / "examples" / "rljob-cpu.yaml").read_text())
    job["metadata"]["name"] = "too-big"
    job["spec"].update(base={"format": "int4", "nodeCache": "demo", "architecture": "deepseek-v3"},
                       model={"dtype": "bf16"}, learner={"device": "cuda"}, nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H200"},
                       resources={"rollout": {"gpus": 4, "memory": "1500Gi"}, "learner": {"gpus": 4, "memory": "1500Gi"}},
                       rollout={"tensor_parallel_size": 4, "max_tokens": 1024, "max_model_len": 2048})  # fmt: skip
    path = tmp_path / "too-big.yaml"
    path.write_text(yaml.safe_dump(job))
    job_path = KubeEmulator.path(RLJOBS, NS, "too-big")
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1")) as proc:
        kube.kubectl("apply", "--validate=false", "-f", str(path))
        wait(kube, lambda: status(kube, job_path).get("phase") == "Failed", "refused")
        failed = next(c for c in status(kube, job_path)["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "DoesNotFit", failed
        assert "learner on 1 x H200 needs" in failed["message"] and "base_int4 321.3" in failed["message"], failed
        assert status(kube, job_path)["plan"].startswith("does not fit:")
        wait(kube, lambda: any(e["reason"] == "DoesNotFit" and e["type"] == "Warning" for e in kube.events(involved_name="too-big")),
             "a DoesNotFit event")  # fmt: skip
        assert not [p for p in kube.list_pods(NS) if p["metadata"]["name"].startswith("too-big")]
        metrics_port = proc.env["ORBIT_METRICS_PORT"]
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert 'orbit_operator_does_not_fit_total{stage="admission"} 1.0' in scraped, scraped
        # `orbit validate` says the same before anything is applied
        check = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "validate", str(path)], capture_output=True, text=True,
                               cwd=REPO_ROOT)  # fmt: skip
        assert check.returncode == 1 and "DoesNotFit: learner on 1 x H200 needs" in check.stderr, check.stderr
        # edited to a model that fits one H200 per role: it starts, with the plan in its status
        kube.kubectl("patch", "rljob", "too-big", "--type=merge", "-p",
                     '{"spec":{"base":{"architecture":"qwen3-8b"},"rollout":{"tensor_parallel_size":1},'
                     '"resources":{"rollout":{"gpus":1},"learner":{"gpus":1}}}}')  # fmt: skip
        created = wait(kube, lambda: pods(kube).get("too-big-0"), "its first pod")
        wait(kube, lambda: status(kube, job_path).get("phase") == "Pending", "Pending")
        assert status(kube, job_path)["plan"].startswith("fits: rollout 1xH200"), status(kube, job_path)
        assert not [c for c in status(kube, job_path)["conditions"] if c["type"] == "Failed"]
        prepare = created["spec"]["initContainers"][0]["command"]
        assert "--enforce-fit" in prepare and "/etc/orbit/plan.json" in prepare  # prepare-base plans it again, with the base
