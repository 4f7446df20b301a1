"""The Helm chart, rendered offline with Helm's own Go SDK (helm-python-sdk): every manifest is
valid Kubernetes, the operator is configured the way its settings parser reads it, and
values.schema.json refuses bad values. (RBAC against real use: tests/kube/test_rbac.py.)"""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from orbit_operator.pod import build_pod
from orbit_operator.settings import OperatorSettings
from orbit_operator.validation import validate_job

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "orbit"
K8S_VERSION = "1.32"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
# Prometheus Operator resources: their CRDs are not part of Kubernetes' schemas, so
# kubernetes-validate cannot check them; they are skipped by kind. Their fields are checked by
# test_monitoring_objects_select_what_exists and tests/unit/test_chart_monitoring.py.
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
EVERYTHING_ON = {
    "watchNamespaces": ["team-a", "team-b"],
    "imagePullSecrets": ["registry"],
    "operator": {"nodeSelector": {"node-role": "system"}, "tolerations": [{"key": "system", "operator": "Exists"}],
                 "podLabels": {"team": "ml"}, "podAnnotations": {"a": "b"}, "nodeGpu": "H200"},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                   "podMonitor": {"enabled": True, "labels": {"release": "prom"}},
                   "prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True, "folder": "ML"}},
    "podSecurity": {"admissionPolicy": True}, "networkPolicy": {"enabled": True},
}  # fmt: skip


def render(values: dict | None = None) -> list[dict]:
    """Every object the chart renders (NOTES.txt aside)."""
    manifests = helm.Chart.load(CHART).render(values, name="orbit", namespace="orbit-system")
    return [doc for path, text in manifests.items() if not path.endswith("NOTES.txt") for doc in yaml.safe_load_all(text) if doc]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


@pytest.mark.parametrize("values", [None, EVERYTHING_ON], ids=["defaults", "everything-on-namespaced"])
def test_every_rendered_manifest_is_strictly_valid_kubernetes(values):
    objects = render(values)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ServiceAccount", "Service", "ConfigMap"} <= kinds
    for obj in objects:
        if obj["kind"] not in MONITORING_KINDS:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    if values is EVERYTHING_ON:
        assert MONITORING_KINDS <= kinds
        roles = by_kind(objects, "Role")
        assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]  # a Role per watched namespace
        assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")  # nothing cluster-wide
    else:
        assert [r["metadata"]["name"] for r in by_kind(objects, "ClusterRole")] == ["orbit-operator"] and not by_kind(objects, "Role")
    for role in by_kind(objects, "ClusterRole") + by_kind(objects, "Role"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule


def test_the_operator_deployment_configures_the_operator_as_its_settings_read_it():
    (deployment,) = by_kind(render(EVERYTHING_ON), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}  # kopf standalone: never two at once
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    settings = OperatorSettings.from_env(env)  # the operator's own parser
    assert settings.namespaces == ("team-a", "team-b") and settings.cache_root == "/var/lib/orbit/bases"
    assert settings.runtime_image == f"ghcr.io/orbit-rl/orbit-runtime:{APP_VERSION}"
    assert container["image"] == f"ghcr.io/orbit-rl/orbit-operator:{APP_VERSION}"
    assert settings.run_as_user == 10001 and settings.learner_status_port == 9400
    assert settings.node_gpu == "H200" and settings.node_gpu_memory_gib is None  # the planner's node at admission
    default_env = {e["name"]: e["value"] for e in by_kind(render(), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert OperatorSettings.from_env(default_env).node_gpu is None  # unset: jobs are planned by their prepare-base
    sized = by_kind(render({"operator": {"nodeGpuMemoryGiB": 96}}), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert OperatorSettings.from_env({e["name"]: e["value"] for e in sized["env"]}).node_gpu_memory_gib == 96
    assert container["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    assert container["livenessProbe"]["httpGet"]["port"] == "health" and container["readinessProbe"]
    assert pod["nodeSelector"] == {"node-role": "system"} and pod["imagePullSecrets"] == [{"name": "registry"}]


def test_monitoring_objects_select_what_exists():
    objects = render(EVERYTHING_ON)
    (service,) = by_kind(objects, "Service")
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["spec"]["selector"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    (pod_monitor,) = by_kind(objects, "PodMonitor")
    job_pod = build_pod("job", "team-a", validate_job(yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())).spec,
                        OperatorSettings())  # fmt: skip
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= job_pod["metadata"]["labels"].items()
    ports = {p["name"] for c in job_pod["spec"]["initContainers"] + job_pod["spec"]["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} == ports == {"learner", "rollout", "reference"}
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


BAD_VALUES = {
    "a GPU the planner does not know": ({"operator": {"nodeGpu": "A100"}}, "nodeGpu"),
    "unknown top-level key": ({"cacheroot": "/x"}, "additional properties"),
    "unknown nested key": ({"operator": {"replicas": 2}}, "additional properties"),
    "relative cache root": ({"cacheRoot": "var/lib/orbit"}, "/cacheRoot"),
    "cache root escaping": ({"cacheRoot": "/var/lib/../../etc"}, "/cacheRoot"),
    "log level": ({"operator": {"logLevel": "LOUD"}}, "/operator/logLevel"),
    "pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "gpus per node": ({"operator": {"maxGpusPerNode": 0}}, "/operator/maxGpusPerNode"),
    "poll seconds": ({"operator": {"statusPollSeconds": 0}}, "/operator/statusPollSeconds"),
    "port of a role": ({"operator": {"learnerStatusPort": 8000}}, "/operator/learnerStatusPort"),
    "root user": ({"runtimeUser": 0}, "/runtimeUser"),
    "namespace name": ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0"),
    "image tag": ({"image": {"runtime": {"repository": "r", "tag": "has space"}}}, "/image/runtime/tag"),
    "flag type": ({"monitoring": {"podMonitor": {"enabled": "yes"}}}, "/monitoring/podMonitor/enabled"),
    "interval": ({"monitoring": {"podMonitor": {"interval": "often"}}}, "/monitoring/podMonitor/interval"),
    "selector label": ({"operator": {"podLabels": {"app.kubernetes.io/component": "x"}}}, "app.kubernetes.io/component"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_values_schema_refuses_bad_values_naming_them(case):
    values, where = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError) as refused:
        render(values)
    assert where in str(refused.value), str(refused.value)


def test_lint_is_clean_with_everything_on_and_a_large_uid():
    report = helm.lint(CHART, {**EVERYTHING_ON, "runtimeUser": 1000680000}, strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    (deployment,) = by_kind(render({"runtimeUser": 1000680000}), "Deployment")  # an OpenShift-range UID, not 1.00068e+09
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert OperatorSettings.from_env(env).run_as_user == 1000680000


def test_notes_tell_the_next_commands():
    notes = helm.Chart.load(CHART).render(EVERYTHING_ON, name="orbit", namespace="orbit-system")["orbit/templates/NOTES.txt"]
    assert "kubectl apply -n <namespace> -f examples/rljob.yaml" in notes and "kubectl get rljob -n <namespace> -w" in notes
    assert "team-a, team-b" in notes and "orbit-grafana-dashboard" in notes
