"""The real operator process against the API emulator, on who may reach a job and what it may touch:
the per-job API key (a Secret the operator owns, in the serving roles and the learner only, sent with
its /status poll), the per-job NetworkPolicy, names taken by objects that are not the job's (never
overwritten), the values of the job's Secrets masked in conditions, events and the operator's log,
and the allowlists for what a job puts on its pod. (Rendered-object checks: tests/unit/test_pod_security.py.)"""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from orbit_runtime.observability.server import MetricsServer
from orbit_runtime.processes import free_port
from orbit_runtime.trainer.recorder import RunState, status_document
from tests.kube.emulator import REPO_ROOT, RLJOBS, KubeEmulator
from tests.kube.test_operator import JOB, JOB_PATH, NS, operator_process, pods, status, wait, wait_for_reconciles

SECRET_VALUE = "s3cr3t-Value-no-one-may-read-9f2e"  # under a key no redaction list knows
ODD_KEY = "x.registry_Token-2"


def _secret(name: str, data: dict[str, str], owner: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS,
            **({"ownerReferences": [owner]} if owner else {})},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}  # fmt: skip


def _controller_uid(obj: dict) -> str | None:
    return next((r["uid"] for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_api_key_network_policy_foreign_objects_and_redaction(kube: KubeEmulator, tmp_path: Path) -> None:
    status_port = free_port("127.0.0.1")
    kube.create(KubeEmulator.path("v1/secrets", NS), _secret("orbit-s3", {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY12",
                                                                           "AWS_SECRET_ACCESS_KEY": "wJalrEXAMPLEsecretKEY",
                                                                           ODD_KEY: SECRET_VALUE}))  # fmt: skip
    # a second job whose NetworkPolicy name is taken by an object that is not its own
    other = yaml.safe_load((REPO_ROOT / "examples" / "rljob-cpu.yaml").read_text())
    other["metadata"]["name"] = "other"
    foreign = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "other-ingress", "namespace": NS},
               "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{}]}}  # fmt: skip
    kube.create(KubeEmulator.path("networking.k8s.io/v1/networkpolicies", NS), foreign)
    state = RunState(step=3, adapter_version=3, rows=[{"kind": "step", "step": 3, "reward_mean": 0.5}])
    server = MetricsServer(CollectorRegistry(), "127.0.0.9", status_port, status=lambda: status_document(
        state, phase="running", max_steps=4, checkpoint_uri="s3://orbit-test/quickstart-cpu", last_checkpoint_step=2,
        restarts={"rollout": 0, "reference": 0}), api_key="not-yet-known")  # fmt: skip
    server.start()
    env = {"ORBIT_NETWORK_POLICY": "true", "ORBIT_OPERATOR_NAMESPACE": "orbit-system", "ORBIT_MONITORING_NAMESPACE": "monitoring",
           "ORBIT_OPERATOR_POD_LABELS": "app.kubernetes.io/component=operator"}  # fmt: skip
    log_path = tmp_path / "operator.log"
    try:
        with operator_process(kube, log_path, status_port, extra_env=env) as proc:
            kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
            pod = wait(kube, lambda: pods(kube).get(f"{JOB}-0"), "the first pod")
            uid = kube.get(JOB_PATH)["metadata"]["uid"]

            # the job's API key: random, owned by the job, in the serving roles and the learner, not prepare-base
            secret = kube.get(KubeEmulator.path("v1/secrets", NS, f"{JOB}-api-key"))
            assert _controller_uid(secret) == uid
            key = base64.b64decode(secret["data"]["api-key"]).decode()
            assert len(key) >= 40
            containers = {c["name"]: c for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]}
            for name in ("rollout", "learner"):
                assert _env(containers[name])["ORBIT_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": f"{JOB}-api-key",
                                                                                                 "key": "api-key"}}  # fmt: skip
            assert "ORBIT_API_KEY" not in _env(containers["prepare-base"])
            # the learner knows which of its variables are secret, whatever their names
            assert ODD_KEY in _env(containers["learner"])["ORBIT_REDACT_ENV"]["value"].split(",")
            assert _env(containers["prepare-base"])["NVIDIA_VISIBLE_DEVICES"]["value"] == "void"  # no GPU requested

            policy = kube.get(KubeEmulator.path("networking.k8s.io/v1/networkpolicies", NS, f"{JOB}-ingress"))
            assert _controller_uid(policy) == uid and policy["spec"]["podSelector"]["matchLabels"] == {"orbit.dev/job": JOB}

            # the operator polls /status with the key: nothing without it
            kube.set_pod_status(NS, f"{JOB}-0", "Running", pod_ip="127.0.0.9")
            wait_for_reconciles(kube, proc, 3)
            assert "progress" not in status(kube)  # the learner's server still asks for another key
            server.api_key = key
            wait(kube, lambda: status(kube).get("progress", {}).get("step") == 3, "progress, polled with the job's key")

            # a failure whose message carries a Secret's value: masked in the condition, the events and the log
            kube.set_pod_status(NS, f"{JOB}-0", "Failed", exit_code=1, reason="Error",
                                message=f"botocore: bad token {SECRET_VALUE} for key {key}")  # fmt: skip
            wait(kube, lambda: status(kube).get("failures") == 1, "the failure counted")
            wait(kube, lambda: any("bad token" in e["message"] for e in kube.events(involved_name=JOB)), "a PodFailed event")
            written = yaml.safe_dump([status(kube), kube.events(involved_name=JOB)])
            assert "bad token ***" in written and SECRET_VALUE not in written and key not in written

            # a name taken by someone else's object: never touched, the job waits and says why
            kube.create(KubeEmulator.path(RLJOBS, NS), other)
            wait(kube, lambda: any(e["reason"] == "NotOwned" and "other-ingress" in e["message"]
                                   for e in kube.events(involved_name="other")), "a NotOwned event")  # fmt: skip
            wait_for_reconciles(kube, proc, 3)
            assert "other-0" not in pods(kube)
            assert kube.get(KubeEmulator.path("networking.k8s.io/v1/networkpolicies", NS, "other-ingress"))["spec"] == foreign["spec"]
            kube.delete(KubeEmulator.path("networking.k8s.io/v1/networkpolicies", NS, "other-ingress"))
            wait(kube, lambda: pods(kube).get("other-0"), "the other job's pod once the name is free")
    finally:
        server.stop()
    log = log_path.read_text()
    assert SECRET_VALUE not in log and key not in log


def test_a_foreign_configmap_is_never_overwritten_and_pod_metadata_follows_the_allowlists(kube: KubeEmulator, tmp_path: Path) -> None:
    job = yaml.safe_load((REPO_ROOT / "examples" / "rljob-cpu.yaml").read_text())
    mine = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{JOB}-config", "namespace": NS}, "data": {"mine": "1"}}
    kube.create(KubeEmulator.path("v1/configmaps", NS), mine)
    allow = {"ORBIT_ALLOWED_PRIORITY_CLASSES": "rl-training", "ORBIT_ALLOWED_POD_LABELS": "team,kueue.x-k8s.io/*"}
    with operator_process(kube, tmp_path / "operator.log", free_port("127.0.0.1"), extra_env=allow) as proc:
        kube.create(KubeEmulator.path(RLJOBS, NS), job)
        wait(kube, lambda: any(c["reason"] == "WaitingForOldObjects" for c in status(kube).get("conditions", [])), "waiting")
        wait_for_reconciles(kube, proc, 3)
        assert kube.get(KubeEmulator.path("v1/configmaps", NS, f"{JOB}-config"))["data"] == {"mine": "1"} and not pods(kube)

        denied = copy.deepcopy(job)
        denied["metadata"]["name"] = "greedy"
        denied["spec"].update(priorityClassName="system-cluster-critical", podLabels={"team": "a", "app": "payments"})
        kube.create(KubeEmulator.path(RLJOBS, NS), denied)
        path = KubeEmulator.path(RLJOBS, NS, "greedy")
        invalid = wait(kube, lambda: [c for c in status(kube, path).get("conditions", []) if c["type"] == "Invalid"], "Invalid")
        assert "spec.priorityClassName: 'system-cluster-critical' is not allowed" in invalid[0]["message"]
        assert "spec.podLabels: 'app' not allowed" in invalid[0]["message"] and not pods(kube)


def test_the_client_never_patches_an_object_of_the_jobs_name_it_does_not_own(kube: KubeEmulator, tmp_path_factory) -> None:
    """The race the planner cannot see: the ConfigMap or Secret appears between the read and the create (409)."""
    import pytest
    from kubernetes import config

    from orbit_operator.kube import Kube, NotOwned

    config.load_kube_config(str(kube.write_kubeconfig(tmp_path_factory.mktemp("kc") / "kubeconfig", default=False)))
    api = Kube()
    owner = {"apiVersion": "orbit.dev/v1alpha1", "kind": "RLTrainingJob", "name": JOB, "uid": "job-uid-1", "controller": True}
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{JOB}-config", "namespace": NS}, "data": {"mine": "1"}}
    kube.create(KubeEmulator.path("v1/configmaps", NS), foreign)
    ours = {**foreign, "metadata": {**foreign["metadata"], "ownerReferences": [owner]}, "data": {"job.yaml": "x"}}
    with pytest.raises(NotOwned, match=f"ConfigMap {NS}/{JOB}-config exists and is not this job's"):
        api.apply_configmap(ours)
    assert kube.get(KubeEmulator.path("v1/configmaps", NS, f"{JOB}-config"))["data"] == {"mine": "1"}
    kube.create(KubeEmulator.path("v1/secrets", NS), _secret(f"{JOB}-api-key", {"api-key": "someone-elses"}))
    with pytest.raises(NotOwned, match="Secret"):
        api.create_owned_secret(_secret(f"{JOB}-api-key", {"api-key": "new"}, owner))
    mine = _secret("job-2-api-key", {"api-key": "k"}, {**owner, "uid": "job-uid-2"})
    kube.create(KubeEmulator.path("v1/secrets", NS), mine)
    assert base64.b64decode(api.create_owned_secret(_secret("job-2-api-key", {"api-key": "other"}, {**owner, "uid": "job-uid-2"}))
                            ["data"]["api-key"]).decode() == "k"  # ours already: the stored key is kept  # fmt: skip
