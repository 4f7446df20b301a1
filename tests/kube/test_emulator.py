"""The API emulator works for real clients: kubectl and a real `kopf run` process (see tests/kube/emulator/)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.kube.emulator import RLJOBS, KubeApiError, KubeEmulator, kopf_operator

JOB = KubeEmulator.path(RLJOBS, "default", "quickstart-cpu")
CONFIGMAP = KubeEmulator.path("v1/configmaps", "default", "quickstart-cpu-config")

OPERATOR = textwrap.dedent("""
    import kopf
    import kubernetes


    @kopf.on.startup()
    def configure(**_):
        kubernetes.config.load_kube_config()


    @kopf.on.create("orbit.dev", "v1alpha1", "rltrainingjobs")
    def created(body, name, namespace, patch, **_):
        configmap = {"metadata": {"name": f"{name}-config", "labels": {"orbit.dev/job": name}}, "data": {"job": name}}
        kubernetes.client.CoreV1Api().create_namespaced_config_map(namespace, configmap)
        patch.status["phase"] = "Pending"
        kopf.info(body, reason="Configured", message=f"ConfigMap {name}-config created")  # a k8s Event


    @kopf.on.delete("orbit.dev", "v1alpha1", "rltrainingjobs")  # makes kopf put (and later remove) a finalizer
    def deleted(name, namespace, **_):
        kubernetes.client.CoreV1Api().delete_namespaced_config_map(f"{name}-config", namespace)
""")


def test_kubectl_and_kopf_against_the_emulator(kube: KubeEmulator, tmp_path: Path) -> None:
    applied = kube.kubectl("apply", "--validate=false", "-f", "examples/rljob-cpu.yaml")
    assert "quickstart-cpu created" in applied.stdout
    listed = kube.kubectl("get", "rljob")
    assert "quickstart-cpu" in listed.stdout and "PHASE" in listed.stdout
    job = kube.get(JOB)
    assert job["metadata"]["uid"] and job["metadata"]["generation"] == 1 and "status" not in job

    script = tmp_path / "operator.py"
    script.write_text(OPERATOR)
    with kopf_operator(kube, script.as_posix(), log_path=tmp_path / "kopf.log"):
        job = kube.wait_for(
            lambda: (j := kube.get(JOB)) and j.get("status", {}).get("phase") == "Pending" and j,
            timeout=40,
            message="the job's status.phase=Pending",
        )
        assert job["metadata"]["finalizers"]  # kopf's, for the on.delete handler
        assert job["metadata"]["generation"] == 1  # status and metadata patches do not bump it
        configmap = kube.wait_for(lambda: kube.get(CONFIGMAP), message="the ConfigMap")
        assert configmap["data"] == {"job": "quickstart-cpu"}
        kube.wait_for(lambda: kube.events(involved_name="quickstart-cpu"), message="kopf's events")
        assert "Pending" in kube.kubectl("get", "rljob", "quickstart-cpu").stdout

        deleted = kube.kubectl("delete", "rljob", "quickstart-cpu", "--timeout=30s")  # waits until it is gone
        assert "deleted" in deleted.stdout
        assert kube.get(JOB) is None
        assert kube.get(CONFIGMAP) is None
        assert "No resources found" in kube.kubectl("get", "rljob").stderr


def test_server_semantics(kube: KubeEmulator) -> None:
    jobs = kube.path(RLJOBS, "default")
    job = kube.create(
        jobs,
        {
            "apiVersion": "orbit.dev/v1alpha1",
            "kind": "RLTrainingJob",
            "metadata": {"name": "j"},
            "spec": {"a": 1},
            "status": {"phase": "ignored"},
        },
    )
    path, rv = kube.path(RLJOBS, "default", "j"), job["metadata"]["resourceVersion"]
    assert "status" not in job and job["metadata"]["generation"] == 1

    job = kube.patch(path, {"spec": {"a": 2}, "status": {"phase": "ignored"}})
    assert job["spec"] == {"a": 2} and "status" not in job and job["metadata"]["generation"] == 2
    assert job["metadata"]["name"] == "j" and job["metadata"]["uid"] and job["metadata"]["namespace"] == "default"
    job = kube.patch_status(path, {"phase": "Pending"})
    assert job["status"] == {"phase": "Pending"} and job["metadata"]["generation"] == 2
    assert kube.patch_status(path, {"phase": "Pending"})["metadata"]["resourceVersion"] == job["metadata"]["resourceVersion"]

    stale = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x"]},
    ]
    status, _ = kube.request("PATCH", path, stale, content_type="application/json-patch+json")
    assert status == 422
    fresh = [dict(stale[0], value=job["metadata"]["resourceVersion"]), stale[1]]
    assert kube.patch(path, fresh, patch_type="json")["metadata"]["finalizers"] == ["x"]

    assert kube.delete(path)["metadata"]["deletionTimestamp"]
    assert kube.get(path)["metadata"]["deletionTimestamp"]  # held by the finalizer
    kube.patch(path, {"metadata": {"finalizers": None}})
    assert kube.get(path) is None and kube.list(jobs) == []

    pods = kube.path("v1/pods", "default")
    kube.create(
        pods,
        {
            "metadata": {"name": "p", "labels": {"role": "learner"}},
            "spec": {"containers": [{"name": "learner", "image": "orbit"}]},
        },
    )
    kube.create(pods, {"metadata": {"generateName": "other-"}, "spec": {"containers": []}})
    assert [p["metadata"]["name"] for p in kube.list_pods(label_selector="role=learner")] == ["p"]
    assert kube.get(kube.path("v1/pods", "default", "p"))["status"]["phase"] == "Pending"
    pod = kube.set_pod_status("default", "p", "Running")
    assert pod["status"]["podIP"] and pod["status"]["containerStatuses"][0]["state"]["running"]
    pod = kube.set_pod_status("default", "p", "Failed", exit_code=137, reason="OOMKilled")
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137
    assert kube.list(pods, field_selector="status.phase=Failed")[0]["metadata"]["name"] == "p"

    try:
        kube.create(kube.path("example.com/v1/widgets", "default"), {"metadata": {"name": "w"}})
    except KubeApiError as e:
        assert e.status == 404
    else:
        raise AssertionError("an unknown resource was accepted")


def test_garbage_collection_graceful_pod_deletion_and_injected_errors(kube: KubeEmulator) -> None:
    """What hid the operator's ownership bugs: dependents outlive their owner for a grace period."""
    owner = kube.create(KubeEmulator.path("v1/configmaps", "default"), {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"], "controller": True}
    pods = KubeEmulator.path("v1/pods", "default")
    for name in ("bound", "unbound"):
        kube.create(pods, {"metadata": {"name": name, "ownerReferences": [ref]}, "spec": {"containers": [{"name": "c", "image": "x"}]}})
    kube.create(KubeEmulator.path("v1/configmaps", "default"), {"metadata": {"name": "dependent", "ownerReferences": [ref]}})
    kube.create(KubeEmulator.path("v1/configmaps", "default"), {"metadata": {"name": "unowned"}})
    kube.bind_pod("default", "bound")
    kube.set_pod_status("default", "bound", "Running")
    kube.delete(KubeEmulator.path("v1/configmaps", "default", "owner"))
    remaining = {p["metadata"]["name"]: p for p in kube.list_pods("default")}
    assert list(remaining) == ["bound"] and remaining["bound"]["metadata"]["deletionTimestamp"]  # terminating, not gone
    assert kube.get(KubeEmulator.path("v1/configmaps", "default", "dependent")) is None
    assert kube.get(KubeEmulator.path("v1/configmaps", "default", "unowned")) is not None
    kube.finish_pod_deletion("default", "bound")
    assert kube.list_pods("default") == []

    kube.inject_error("create", "pods", 429, "TooManyRequests", "too many requests, please try again later", times=2)
    body = {"metadata": {"name": "later"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    for _ in range(2):
        status, payload = kube.request("POST", pods, body)
        assert status == 429 and payload["reason"] == "TooManyRequests"
    assert kube.request("POST", pods, body)[0] == 201
