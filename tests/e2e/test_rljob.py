"""`kubectl apply -f` an RLTrainingJob and it trains: the real operator process, the emulated API
server, and a test node (tests/e2e/node.py) that runs the operator's pod as sandboxed processes:
`orbit prepare-base` quantizes the base from S3 (moto) into the node's hostPath cache, then
`orbit rollout` (real vLLM, CPU build), `orbit reference` and `orbit learner` talk over the pod
IP; checkpoints go to S3. Mocked because nothing else can run here: the cluster (API server and
kubelet are emulated; images, scheduling and resource limits are not).

The tests share one node, operator and S3 bucket. The second job finds its base in the node's
cache: the first job's, or (run alone) one prepared for it as a pod's prepare-base does.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from orbit_operator.job_access import build_api_key_secret
from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_operator.pod import base_cache_dir, build_configmap, build_pod
from orbit_operator.settings import OperatorSettings
from orbit_runtime.processes import free_port
from tests.e2e.node import ProcessNode
from tests.kube.emulator import ORBIT_CRD, RLJOBS, KubeEmulator
from tests.kube.test_operator import operator_process, wait_for_reconciles
from tests.prometheus import Prometheus, assert_dashboards_and_rules_have_data

pytestmark = pytest.mark.vllm
NS = "default"
# scored by the learner and by a fresh vLLM after the run (token ids of the demo model's vocabulary)
CANARY = [([97, 86, 84, 70, 83, 0], [18, 19, 12, 24, 98]), ([97, 66, 67, 68], [20, 21, 22])]


def job_spec(bucket: str, name: str, steps: int) -> dict:
    """A CPU job: the demo model from S3, GRPO on arithmetic prompts, checkpoints to S3 every 2 steps."""
    return {
        "base": {"format": "hf", "uri": f"s3://{bucket}/models/demo", "credentialsSecret": "orbit-s3"},
        "model": {"dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16},
        "algorithm": {"kl_beta": 0.02},  # the KL panels and rules read the reference's log-probs
        "data": {"type": "synthetic_arithmetic", "operations": ["*"], "max_value": 99, "right_values": [10], "validation_size": 8},
        # the untrained demo model writes random characters: a reward about half of them earn, so the adapter moves
        "rewards": [{"function": "regex", "kwargs": {"pattern": "[a-z][a-z]"}}],
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 12, "kv_cache_gib": 1},
        "reference": {"mode": "server"},
        "learner": {"device": "cpu", "gradient_checkpointing": False},
        "schedule": {"steps": steps, "learning_rate": 2.0e-3},
        "eval": {"every_steps": 4},
        "checkpoint": {"uri": f"s3://{bucket}/{name}", "every_steps": 2, "credentialsSecret": "orbit-s3"},
        "run": {"name": name},
        "resources": {"rollout": {"gpus": 0, "cpu": "1", "memory": "4Gi"}, "reference": {"gpus": 0, "cpu": "500m", "memory": "2Gi"},
                      "learner": {"gpus": 0, "cpu": "1", "memory": "4Gi"}},
        "backoffLimit": 2,
    }  # fmt: skip


@dataclass
class Cluster:
    kube: KubeEmulator
    node: ProcessNode
    bucket: str
    s3_env: dict[str, str]
    cache_root: Path
    status_port: int
    tmp: Path
    operator: Any = None  # the operator process (its metrics count reconciles)

    def apply(self, name: str, steps: int, **spec) -> dict:
        """`kubectl apply -f` a job (see job_spec)."""
        manifest = {"apiVersion": "orbit.dev/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": name, "namespace": NS},
                    "spec": {**job_spec(self.bucket, name, steps), **spec}}  # fmt: skip
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        self.kube.kubectl("apply", "--validate=false", "-f", str(path))  # the emulator serves no OpenAPI schema
        return manifest

    def job(self, name: str) -> dict:
        return self.kube.get(self.kube.path(RLJOBS, NS, name)) or {}

    def status(self, name: str) -> dict:
        return self.job(name).get("status") or {}

    def pod(self, name: str) -> dict:
        return self.kube.get(self.kube.path("v1/pods", NS, name)) or {}

    def wait(self, predicate, message: str, timeout: float, pod: str | None = None):
        """Wait; on timeout, the message carries the job's status and the pod's container logs."""
        try:
            return self.kube.wait_for(predicate, timeout=timeout, interval=0.5, message=message)
        except AssertionError as exc:
            logs = "".join(f"\n--- {c} ---\n{self.node.log(NS, pod, c)[-3000:]}" for c in ("prepare-base", "rollout", "reference", "learner")) if pod else ""
            raise AssertionError(f"{exc}\nstatus: {json.dumps(self.status(pod.rsplit('-', 1)[0]) if pod else {}, indent=1)[:3000]}{logs}") from None  # fmt: skip

    def steps(self, pod: str) -> list[dict]:
        """The step rows of the learner's metrics.jsonl in POD's run volume (kept by the node after the pod)."""
        files = list(self.node.root.glob(f"pods/{NS}_{pod}_*/volumes/run/*/metrics.jsonl"))
        rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
        return rows

    def checkpoints(self, name: str) -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "checkpoints", "list", f"s3://{self.bucket}/{name}", "--json"],
                             env={**os.environ, **self.s3_env}, capture_output=True, text=True, check=True)  # fmt: skip
        return json.loads(out.stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, demo_dir, s3_endpoint):
    tmp = tmp_path_factory.mktemp("e2e")
    bucket = s3_endpoint.new_bucket()
    client = s3_endpoint.client()
    for file in demo_dir.iterdir():  # the job's source: a Hugging Face checkpoint in object storage
        client.upload_file(str(file), bucket, f"models/demo/{file.name}")
    status_port = free_port("127.0.0.1")
    with KubeEmulator() as kube:
        kube.load_crd(ORBIT_CRD)
        kube.write_kubeconfig(tmp / "kubeconfig")
        secret = {"metadata": {"name": "orbit-s3"}, "type": "Opaque",
                  "data": {k: base64.b64encode(v.encode()).decode() for k, v in s3_endpoint.env().items()}}  # fmt: skip
        kube.create(kube.path("v1/secrets", NS), secret)
        settings = {"ORBIT_CACHE_ROOT": str(tmp / "node-cache"), "ORBIT_STATUS_POLL_SECONDS": "1", "ORBIT_BACKOFF_BASE_SECONDS": "2"}
        with ProcessNode(kube, tmp / "node") as node, operator_process(kube, tmp / "operator.log", status_port, settings) as operator:
            yield Cluster(kube, node, bucket, s3_endpoint.env(), tmp / "node-cache", status_port, tmp, operator)


def _cache_history(cluster: Cluster, manifest: dict) -> list[dict]:
    spec = RLTrainingJobSpec.model_validate(manifest["spec"])
    path = cluster.cache_root / base_cache_dir(spec, NS) / "prepared.json"
    return json.loads(path.read_text()) if path.exists() else []


def _container(pod: dict, name: str) -> dict:
    status = pod.get("status") or {}
    return next((c for c in status.get("initContainerStatuses", []) + status.get("containerStatuses", []) if c["name"] == name), {})


def test_a_role_cannot_write_to_the_base_or_its_root_filesystem(cluster: Cluster):
    """The operator's own pod (build_pod) with its commands swapped for writes: the sandbox's
    read-only mounts and root are real, and a role says so in one line."""
    # an administrator's base name: the node creates the (empty) subPath, which must not be the jobs' cache directory
    spec = RLTrainingJobSpec.model_validate({**job_spec(cluster.bucket, "probe", 1), "base": {"format": "int4", "nodeCache": "probe"}})
    settings = OperatorSettings(cache_root=str(cluster.cache_root), learner_status_port=cluster.status_port)
    cluster.kube.create(cluster.kube.path("v1/configmaps", NS), build_configmap("probe", NS, spec, settings))
    cluster.kube.create(cluster.kube.path("v1/secrets", NS), build_api_key_secret("probe", NS, "probe-key"))  # the roles' key
    pod = build_pod("probe", NS, spec, settings)
    learner = pod["spec"]["containers"][0]
    attempts = "import sys\nfor path in sys.argv[1:]:\n    try:\n        open(path, 'w')\n        print(path, 'written')\n" \
               "    except OSError as exc:\n        print(path, exc.strerror)"  # fmt: skip
    learner["command"] = ["orbit", "prepare-base", "--cache", "/base", "--format", "int4", "--source", "/etc/orbit"]
    writer = {**learner, "name": "writer", "command": ["python", "-c", attempts, "/base/x", "/etc/orbit/x", "/x", "/usr/x",
                                                          "/adapters/x", "/var/run/orbit/x", "/tmp/x"]}  # fmt: skip
    for c in (learner, writer):
        c.pop("startupProbe"), c.pop("readinessProbe"), c.pop("livenessProbe")
    pod["spec"].update(initContainers=[], containers=[learner, writer])
    cluster.kube.create(cluster.kube.path("v1/pods", NS), pod)
    done = cluster.wait(lambda: cluster.pod("probe-0").get("status", {}).get("phase") in ("Failed", "Succeeded") and cluster.pod("probe-0"),
                        "the probe pod to finish", 60)  # fmt: skip
    assert done["status"]["phase"] == "Failed"
    assert _container(done, "learner")["state"]["terminated"]["exitCode"] == 1
    log = cluster.node.log(NS, "probe-0", "learner")
    assert "/base: cannot write the cache (Read-only file system" in log, log
    writes = dict(line.split(" ", 1) for line in cluster.node.log(NS, "probe-0", "writer").splitlines() if line.startswith("/"))
    read_only = {p for p, what in writes.items() if what.startswith("Read-only")}
    assert read_only == {"/base/x", "/etc/orbit/x", "/x", "/usr/x"} and len(writes) == 7, writes  # the base, the config, the root
    assert {p for p, what in writes.items() if what == "written"} == {"/adapters/x", "/var/run/orbit/x", "/tmp/x"}  # its emptyDirs
    cluster.kube.delete(cluster.kube.path("v1/pods", NS, "probe-0"))


def test_job_trains_survives_role_deaths_resumes_and_exports_a_servable_adapter(cluster: Cluster, tmp_path):
    steps = 10
    manifest = cluster.apply("job-a", steps)
    # prepare-base quantizes the S3 checkpoint into the node's cache; the three roles start; Running
    cluster.wait(lambda: cluster.status("job-a").get("phase") == "Running", "job-a Running", 600, pod="job-a-0")
    first = cluster.pod("job-a-0")
    assert _container(first, "prepare-base")["state"]["terminated"]["exitCode"] == 0
    # prepare-base planned the pod with the base's config.json: each CPU container's need of its memory limit
    assert cluster.status("job-a")["plan"].startswith("fits: rollout "), cluster.status("job-a")
    plan = cluster.status("job-a")["plan"]  # e.g. "fits: rollout 2.5/4.0 GiB, learner 1.4/4.0 GiB, reference 0.8/2.0 GiB; ..."
    assert ("/4.0 GiB, learner " in plan and "/4.0 GiB, reference " in plan and "/2.0 GiB; tightest" in plan), plan
    history = _cache_history(cluster, manifest)
    assert [h["action"] for h in history] == ["quantized"] and history[0]["source"] == f"s3://{cluster.bucket}/models/demo"
    # the S3 credentials reach the learner only (and prepare-base, through the base's own credentialsSecret)
    environ = {c: cluster.node.environ(NS, "job-a-0", c) for c in ("rollout", "reference", "learner")}
    assert environ["learner"]["AWS_SECRET_ACCESS_KEY"] == cluster.s3_env["AWS_SECRET_ACCESS_KEY"]
    assert not [k for c in ("rollout", "reference") for k in environ[c] if k.startswith("AWS_")]
    assert environ["rollout"]["ORBIT_POD_IP"] == first["status"]["podIP"]

    # the rollout container is killed: the node restarts it, the learner waits for it, re-syncs and trains on
    killed_at = cluster.wait(lambda: cluster.status("job-a").get("progress", {}).get("step", 0), "step 1", 300, pod="job-a-0")
    cluster.node.kill(NS, "job-a-0", "rollout")
    cluster.wait(lambda: _container(cluster.pod("job-a-0"), "rollout").get("restartCount") == 1, "the rollout restarted", 30)
    cluster.wait(lambda: cluster.status("job-a").get("progress", {}).get("roleRestarts", {}).get("rollout") == 1,
                 "the learner to notice and re-sync", 300, pod="job-a-0")  # fmt: skip

    # the learner process is killed after a checkpoint: the pod fails, the operator recreates it after backoff
    def trained_on() -> bool:
        progress = cluster.status("job-a").get("progress", {})
        return progress.get("step", 0) >= killed_at + 2 and (progress.get("lastCheckpoint") or {}).get("step", 0) >= 2

    cluster.wait(trained_on, "two steps after the restart, and a checkpoint", 300, pod="job-a-0")
    cluster.node.kill(NS, "job-a-0", "learner")
    failed = cluster.wait(lambda: cluster.pod("job-a-0").get("status", {}).get("phase") == "Failed" and cluster.pod("job-a-0"),
                          "pod 0 Failed", 60)  # fmt: skip
    killed = _container(failed, "learner")["state"]["terminated"]
    assert killed["exitCode"] == 137
    at_failure = max(c["step"] for c in cluster.checkpoints("job-a") if c["complete"])  # what a resume must start from
    cluster.wait(lambda: cluster.status("job-a").get("phase") == "Succeeded", "job-a Succeeded", 900, pod="job-a-1")
    status = cluster.status("job-a")
    assert status["attempt"] == 1 and status["progress"]["step"] == steps  # the final step (the learner's termination message)
    failures = [e["message"] for e in cluster.kube.events(NS, involved_name="job-a") if e.get("reason") == "PodFailed"]
    assert len(failures) == 1 and "pod job-a-0 failed (learner: Error (exit 137)); new pod in 2s" in failures[0], failures
    assert _seconds(cluster.pod("job-a-1")["metadata"]["creationTimestamp"]) - _seconds(killed["finishedAt"]) >= 1  # backoff

    # steps continue: pod 1 resumed from pod 0's last complete checkpoint and redid only what came after it
    rows0, rows1 = cluster.steps("job-a-0"), cluster.steps("job-a-1")
    resumed = next(r for r in rows1 if r["kind"] == "resume")["from_step"]
    steps0 = {r["step"]: r for r in rows0 if r["kind"] == "step"}
    steps1 = [r for r in rows1 if r["kind"] == "step"]
    assert [r["step"] for r in steps1] == list(range(1, steps + 1))  # the run's record: every step once
    assert resumed == at_failure and max(steps0) - resumed <= 2  # the last checkpoint; only what followed it is redone
    assert steps1[:resumed] == [steps0[n] for n in range(1, resumed + 1)]  # the checkpoint's rows, not new ones
    assert any(r.get("rollout_restarts") == 1 for r in rows0 if r["kind"] == "step")
    assert [h["action"] for h in _cache_history(cluster, manifest)] == ["quantized", "verified"]  # pod 1 reused the base
    _assert_the_plan_compares_with_what_the_learner_measured(cluster, manifest, "job-a-1")

    # checkpoints are in S3; the final adapter, exported, is served by a fresh vLLM as the learner scored it
    complete = [c["step"] for c in cluster.checkpoints("job-a") if c["complete"]]
    assert complete and max(complete) == steps  # (older ones pruned by checkpoint.keep_last)
    _assert_fresh_vllm_serves_the_exported_adapter(cluster, manifest, steps, tmp_path)


def _assert_the_plan_compares_with_what_the_learner_measured(cluster: Cluster, manifest: dict, pod: str) -> None:
    """`orbit plan --compare` on the learner's run directory (the pod's run volume), with the cached base's config."""
    (run,) = cluster.node.root.glob(f"pods/{NS}_{pod}_*/volumes/run/*/job.json")
    base = cluster.cache_root / base_cache_dir(RLTrainingJobSpec.model_validate(manifest["spec"]), NS) / "model"
    out = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "plan", "--compare", str(run.parent), "--model-config",
                          str(base), "--json"], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    compared = json.loads(out.stdout)
    assert compared["device"] == "cpu" and compared["steps"] >= 1 and compared["planned"]["first_step_bytes"] > 0
    assert compared["ratio_first_step"] > 0 and compared["ratio_later_steps"] > 0  # step 1 (pod 0, restored with the checkpoint) and later ones


def _seconds(timestamp: str) -> float:
    return datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _assert_fresh_vllm_serves_the_exported_adapter(cluster: Cluster, manifest: dict, step: int, tmp_path: Path) -> None:
    """The checkpoint's adapter is exactly the last one the learner published to its rollout, and a
    fresh vLLM serving it scores the canary as the learner does (base + that adapter, fp32)."""
    import torch
    from safetensors.torch import load_file

    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_policy
    from orbit_runtime.rollout.client import RolloutClient
    from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig
    from orbit_runtime.sync.adapter_sync import AdapterSync, canary_expectations

    exported = tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "checkpoints", "export", f"s3://{cluster.bucket}/job-a", str(step),
                    str(exported)], env={**os.environ, **cluster.s3_env}, check=True, capture_output=True)  # fmt: skip
    weights = load_file(exported / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for k, t in weights.items() if "lora_B" in k), "the adapter never moved: nothing was tested"
    published = sorted(cluster.node.root.glob(f"pods/{NS}_job-a-1_*/volumes/adapters/v*"), key=lambda d: int(d.name[1:]))
    served = load_file(published[-1] / "adapter_model.safetensors")  # the learner's last version, what the rollout served
    # the sync writes the dtype vLLM serves (fp16 here), the checkpoint keeps the learner's fp32
    assert {t.dtype for t in served.values()} == {torch.float16} and {t.dtype for t in weights.values()} == {torch.float32}
    assert served.keys() == weights.keys() and all(torch.equal(served[k], weights[k].to(torch.float16)) for k in weights)
    spec = RLTrainingJobSpec.model_validate(manifest["spec"])
    base = cluster.cache_root / base_cache_dir(spec, NS) / "model"
    policy = load_policy(base, AdapterSpec(rank=8, alpha=16), dtype="fp32")  # the learner's precision
    policy.load_adapter(exported)
    with VLLMServer(VLLMServerConfig(base, dtype="float16", max_lora_rank=8, log_path=tmp_path / "vllm.log")) as server:
        client = RolloutClient(server.base_url)
        result = AdapterSync(client, CANARY, tolerance=2e-2, retries=0).sync(step, exported, canary_expectations(policy, CANARY))
        client.close()
    assert result.canary_mean_abs_dlogp < 5e-3  # fp16 vs fp32: far inside the tolerance, not at it


def _ensure_base_in_cache(cluster: Cluster, spec: RLTrainingJobSpec) -> Path:
    """The job's base in the node's cache: job A's if it ran first, else prepared here by the same
    `orbit prepare-base` command a pod's init container runs (tests/e2e/node.py's mounts aside)."""
    cache = cluster.cache_root / base_cache_dir(spec, NS)
    if not (cache / "model" / "config.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)  # the pod's subPath mount creates it (a test run alone has no job A)
        done = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "prepare-base", "--cache", str(cache), "--format",
                               spec.base.format, "--group-size", str(spec.base.groupSize), "--source", spec.base.uri],
                              env={**os.environ, **cluster.s3_env}, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    return cache / "model"


def test_second_job_reuses_the_base_is_scraped_by_prometheus_suspends_and_resumes(cluster: Cluster, tmp_path):
    """A second job on the same node: its base is already in the cache (see _ensure_base_in_cache)."""
    spec = RLTrainingJobSpec.model_validate(job_spec(cluster.bucket, "job-b", 400))
    model = _ensure_base_in_cache(cluster, spec)
    files_before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in model.iterdir()}
    prepared_before = len(_cache_history(cluster, {"spec": job_spec(cluster.bucket, "job-b", 400)}))
    manifest = cluster.apply("job-b", 400)  # more steps than this test lets it run: it is suspended, resumed, deleted
    cluster.wait(lambda: cluster.status("job-b").get("phase") == "Running", "job-b Running", 600, pod="job-b-0")
    history = _cache_history(cluster, manifest)
    (mine,) = history[prepared_before:]
    (quantized,) = [h for h in history if h["action"] == "quantized"]  # once, for both jobs
    assert mine["action"] == "verified" and mine["seconds"] < quantized["seconds"], (mine, quantized)
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in model.iterdir()} == files_before  # not rewritten

    # Prometheus scrapes the pod's three roles at the pod IP; every dashboard query and rule has data, no alert fires
    ip = cluster.pod("job-b-0")["status"]["podIP"]
    prometheus = Prometheus(tmp_path, {"learner": f"{ip}:{cluster.status_port}", "rollout": f"{ip}:8000", "reference": f"{ip}:8001"})
    try:
        cluster.wait(lambda: prometheus.has_data("count_over_time(orbit_learner_step[1m]) >= 20"), "20 scrapes", 180, pod="job-b-0")
        cluster.wait(lambda: prometheus.has_data("orbit_checkpoint_last_step > 0"), "a checkpoint", 120, pod="job-b-0")
        up = {r["metric"]["orbit_role"]: r["value"][1] for r in prometheus.query("up")["result"]}
        assert up == {"learner": "1", "rollout": "1", "reference": "1"}, up
        assert_dashboards_and_rules_have_data(prometheus)
    finally:
        prometheus.stop()

    # suspend: the pod is stopped gracefully (SIGTERM) and the learner checkpoints its last step first
    cluster.kube.kubectl("patch", "rltrainingjob", "job-b", "--type", "merge", "-p", '{"spec": {"suspend": true}}')
    cluster.wait(lambda: cluster.status("job-b").get("phase") == "Suspended" and not cluster.pod("job-b-0"),
                 "job-b Suspended and its pod gone", 180, pod="job-b-0")  # fmt: skip
    log = cluster.node.log(NS, "job-b-0", "learner")
    stopped = int(log.split("stopped at step ", 1)[1].split()[0])
    assert max(c["step"] for c in cluster.checkpoints("job-b") if c["complete"]) == stopped, log[-2000:]
    wait_for_reconciles(cluster.kube, cluster.operator, 8)  # a few rounds over all jobs: a suspended job gets no new pod
    assert not cluster.kube.list_pods(NS, label_selector="orbit.dev/job=job-b")

    # resume: a new pod continues from that checkpoint
    cluster.kube.kubectl("patch", "rltrainingjob", "job-b", "--type", "merge", "-p", '{"spec": {"suspend": false}}')
    pod = cluster.wait(lambda: [p["metadata"]["name"] for p in cluster.kube.list_pods(NS, label_selector="orbit.dev/job=job-b")],
                       "a new pod", 60)[0]  # fmt: skip
    assert pod != "job-b-0"
    cluster.wait(lambda: cluster.status("job-b").get("progress", {}).get("step", 0) > stopped, "a step after the resume", 600, pod=pod)
    resume = next(r for r in cluster.steps(pod) if r["kind"] == "resume")
    assert resume["from_step"] == stopped  # the checkpoint written on SIGTERM

    # deleting the job stops and removes its pod
    cluster.kube.kubectl("delete", "rltrainingjob", "job-b", timeout=180)
    cluster.wait(lambda: not cluster.kube.list_pods(NS, label_selector="orbit.dev/job=job-b"), "job-b's pod removed", 180)


def test_a_colocated_job_trains_on_the_rollouts_own_base_through_kubectl_apply(cluster: Cluster):
    """placement: colocated in a pod: the learner container maps the rollout container's weight pages
    (the socket in the /dev/shm volume both mount), adapters reach vLLM in memory, no reference server."""
    spec = RLTrainingJobSpec.model_validate(job_spec(cluster.bucket, "job-d", 3))
    _ensure_base_in_cache(cluster, spec)
    cluster.apply("job-d", 3, placement="colocated", model={"dtype": "fp16"}, reference={"mode": "shared"})
    cluster.wait(lambda: cluster.status("job-d").get("phase") == "Succeeded", "job-d Succeeded", 900, pod="job-d-0")
    log = " ".join(cluster.node.log(NS, "job-d-0", "learner").split())  # rich's log lines are wrapped
    assert "placement colocated: the learner computes on the rollout engine's base" in log, log[-2000:]
    steps = [r for r in cluster.steps("job-d-0") if r["kind"] == "step"]
    assert [s["adapter_version"] for s in steps] == [1, 2, 3]
    assert all(s["canary_verdict"] in ("verified", "inconclusive") for s in steps), [s["canary_verdict"] for s in steps]
    summary = json.loads(next(cluster.node.root.glob(f"pods/{NS}_job-d-0_*/volumes/run/*/summary.json")).read_text())
    assert summary["placement"] == "colocated" and summary["shared_base_unchanged"] is True, summary
    assert summary["shared_base_engine_on_shared_pages"] is True and summary["learner_private_base_bytes"] < 4096, summary
    adapters = list(cluster.node.root.glob(f"pods/{NS}_job-d-0_*/volumes/adapters/*"))
    assert not adapters, adapters  # in memory, not through the adapters volume


def test_a_job_whose_base_cannot_fit_fails_in_prepare_base_with_the_breakdown(cluster: Cluster, s3_endpoint):
    """The operator cannot read the base; the pod's prepare-base can. Its base is DeepSeek-V3 (only its
    config.json is in the bucket: prepare-base plans before it downloads or quantizes anything), its
    containers have 2-4 GiB: the first pod fails with DoesNotFit, the job with it, and no pod is retried."""
    from orbit_runtime.plan.catalog import catalog_config

    path = cluster.tmp / "deepseek-config.json"
    path.write_text(json.dumps(catalog_config("deepseek-v3")))
    s3_endpoint.client().upload_file(str(path), cluster.bucket, "models/deepseek/config.json")
    manifest = cluster.apply("job-c", 4, base={"format": "hf", "uri": f"s3://{cluster.bucket}/models/deepseek", "credentialsSecret": "orbit-s3"})
    cluster.wait(lambda: cluster.status("job-c").get("phase") == "Failed", "job-c Failed", 120, pod="job-c-0")
    status = cluster.status("job-c")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DoesNotFit", failed
    assert "learner container needs" in failed["message"] and "of 4.0 GiB (base_int4" in failed["message"], failed
    assert status["plan"].startswith("does not fit: rollout ") and "startTime" not in status  # it never ran
    assert _container(cluster.pod("job-c-0"), "prepare-base")["state"]["terminated"]["exitCode"] == 3
    assert any(e["reason"] == "DoesNotFit" for e in cluster.kube.events(NS, involved_name="job-c"))
    wait_for_reconciles(cluster.kube, cluster.operator, 8)  # a few rounds over all jobs: no second pod (until an edit)
    assert not cluster.pod("job-c-1") and _cache_history(cluster, manifest) == []  # and nothing was quantized

