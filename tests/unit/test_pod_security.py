"""The chart's ValidatingAdmissionPolicy for the operator's pods (docs/pod-security.md): its CEL,
evaluated with cel-python (no API server here evaluates admission policies), lets the pod the
operator builds through and refuses a pod that breaks `restricted` or mounts another host path;
it applies only to what the operator's ServiceAccount creates. Also: a container without GPUs
cannot see the node's, and the per-job NetworkPolicy admits only the pod, the operator and the
monitoring namespace."""

import copy
import json

import celpy
import pytest
import yaml

from orbit_operator.job_access import build_network_policy
from orbit_operator.pod import build_pod
from orbit_operator.settings import OperatorSettings
from orbit_operator.validation import validate_job
from tests.unit.test_chart import ROOT, by_kind, render

CACHE_ROOT = "/var/lib/orbit/bases"  # the chart's default cacheRoot
OPERATOR = "system:serviceaccount:orbit-system:orbit"


def _policy(values: dict | None = None) -> dict:
    (policy,) = by_kind(render({"podSecurity": {"admissionPolicy": True}, **(values or {})}), "ValidatingAdmissionPolicy")
    return policy


def _evaluate(expression: str, activation: dict):
    env = celpy.Environment()
    return env.program(env.compile(expression)).evaluate(activation)


def refusals(policy: dict, pod: dict, username: str = OPERATOR) -> list[str] | None:
    """The messages of the validations POD fails (None: the policy does not match the request at all)."""
    spec = policy["spec"]
    request = celpy.json_to_cel({"userInfo": {"username": username}, "operation": "CREATE"})
    if not all(_evaluate(c["expression"], {"request": request}) for c in spec["matchConditions"]):
        return None
    obj = celpy.json_to_cel(pod)
    variables: dict = {}
    for variable in spec["variables"]:
        variables[variable["name"]] = _evaluate(variable["expression"], {"object": obj, "variables": celpy.celtypes.MapType(variables)})
    activation = {"object": obj, "request": request, "variables": celpy.celtypes.MapType(variables)}
    return [v["message"] for v in spec["validations"] if not bool(_evaluate(v["expression"], activation))]


def operator_pod() -> dict:
    job = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    return build_pod("qwen", "ml", validate_job(job).spec, OperatorSettings(cache_root=CACHE_ROOT), attempt=0)


def test_the_operators_own_pod_passes_the_policy():
    assert refusals(_policy(), operator_pod()) == []


def _with(pod: dict, change) -> dict:
    pod = copy.deepcopy(pod)
    change(pod["spec"])
    return pod


def _learner(spec: dict) -> dict:
    return spec["containers"][0]


REFUSED = {
    "the node's root": (lambda s: s["volumes"].append({"name": "root", "hostPath": {"path": "/"}}), "hostPath"),
    "a path beside the cache": (lambda s: s["volumes"].append({"name": "x", "hostPath": {"path": CACHE_ROOT + "/../../etc"}}),
                                "hostPath"),  # fmt: skip
    "a docker socket": (lambda s: s["volumes"].append({"name": "d", "hostPath": {"path": "/var/run/docker.sock"}}), "hostPath"),
    "a node disk": (lambda s: s["volumes"].append({"name": "g", "gcePersistentDisk": {"pdName": "x"}}), "volume types"),
    "host network": (lambda s: s.update(hostNetwork=True), "host namespaces"),
    "host PID": (lambda s: s.update(hostPID=True), "host namespaces"),
    "a host port": (lambda s: _learner(s)["ports"].append({"containerPort": 1, "hostPort": 80}), "hostPort"),
    "privileged": (lambda s: _learner(s)["securityContext"].update(privileged=True), "not privileged"),
    "escalation": (lambda s: _learner(s)["securityContext"].update(allowPrivilegeEscalation=True), "allowPrivilegeEscalation"),
    "no securityContext": (lambda s: s["initContainers"][0].pop("securityContext"), "allowPrivilegeEscalation"),
    "a capability": (lambda s: _learner(s)["securityContext"]["capabilities"].update(add=["NET_ADMIN"]), "capabilities"),
    "root": (lambda s: _learner(s)["securityContext"].update(runAsNonRoot=False), "non-root"),
    "unconfined": (lambda s: _learner(s)["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccomp"),
    "no seccomp": (lambda s: s["securityContext"].pop("seccompProfile"), "seccomp"),
    "an SELinux super-privileged type": (lambda s: _learner(s)["securityContext"].update(seLinuxOptions={"type": "spc_t"}), "SELinux"),
    "an SELinux user": (lambda s: s["securityContext"].update(seLinuxOptions={"user": "system_u"}), "SELinux"),
    "AppArmor unconfined": (lambda s: _learner(s)["securityContext"].update(appArmorProfile={"type": "Unconfined"}), "AppArmor"),
    "uid 0": (lambda s: _learner(s)["securityContext"].update(runAsUser=0), "root user"),
    "pod uid 0": (lambda s: s["securityContext"].update(runAsUser=0), "root user"),
    "unmasked /proc": (lambda s: _learner(s)["securityContext"].update(procMount="Unmasked"), "unmasked /proc"),
    "a sysctl": (lambda s: s["securityContext"].update(sysctls=[{"name": "kernel.shm_rmid_forced", "value": "1"}]), "sysctls"),
    "a Windows host process": (lambda s: s["securityContext"].update(windowsOptions={"hostProcess": True}), "host process"),
    "an ephemeral container": (lambda s: s.update(ephemeralContainers=[{"name": "debug", "image": "busybox"}]),
                               "allowPrivilegeEscalation"),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_pod_that_breaks_restricted_or_mounts_another_host_path_is_refused(case):
    change, message = REFUSED[case]
    refused = refusals(_policy(), _with(operator_pod(), change))
    assert refused and any(message in m for m in refused), refused


def test_an_apparmor_unconfined_annotation_is_refused():
    pod = operator_pod()
    pod["metadata"].setdefault("annotations", {})["container.apparmor.security.beta.kubernetes.io/learner"] = "unconfined"
    assert any("AppArmor" in m for m in refusals(_policy(), pod))
    pod["metadata"]["annotations"]["container.apparmor.security.beta.kubernetes.io/learner"] = "runtime/default"
    assert refusals(_policy(), pod) == []


def test_a_localhost_seccomp_profile_is_allowed_for_the_sandbox():
    localhost = _with(operator_pod(), lambda s: s["securityContext"].update(seccompProfile={"type": "Localhost",
                                                                                         "localhostProfile": "orbit-bwrap.json"}))  # fmt: skip
    assert refusals(_policy(), localhost) == []


def test_the_policy_holds_only_the_operators_pods_and_follows_the_cache_root():
    root_pod = _with(operator_pod(), lambda s: s["volumes"].append({"name": "root", "hostPath": {"path": "/"}}))
    assert refusals(_policy(), root_pod, username="system:serviceaccount:team-a:default") is None  # Pod Security's, not ours
    moved = _policy({"cacheRoot": "/mnt/bases"})
    assert any("hostPath" in m for m in refusals(moved, operator_pod()))  # a pod with another root is refused
    (binding,) = by_kind(render({"podSecurity": {"admissionPolicy": True}, "watchNamespaces": ["team-a"]}),
                         "ValidatingAdmissionPolicyBinding")  # fmt: skip
    assert binding["spec"]["validationActions"] == ["Deny"] and binding["spec"]["policyName"] == moved["metadata"]["name"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] == ["team-a"]
    assert not by_kind(render(), "ValidatingAdmissionPolicy")  # off by default: it needs the exemption to be useful


def test_containers_without_gpus_cannot_see_the_nodes():
    pod = build_pod("cpu", "ml", validate_job(yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())).spec,
                    OperatorSettings())  # fmt: skip
    containers = {c["name"]: c for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]}
    for name, container in containers.items():
        hidden = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in container["env"]
        assert hidden == ("nvidia.com/gpu" not in container["resources"]["limits"]), name
    assert not [e for e in containers["learner"]["env"] if e["name"] == "NVIDIA_VISIBLE_DEVICES"]  # the device plugin's choice
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in containers["prepare-base"]["env"]
    job = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    job["spec"]["resources"]["reference"]["gpus"] = 0  # a reference server on the CPU: it must not see the GPUs
    cpu_reference = build_pod("cpu", "ml", validate_job(job).spec, OperatorSettings())
    (reference,) = [c for c in cpu_reference["spec"]["initContainers"] if c["name"] == "reference"]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in reference["env"] and reference["command"][-1] == "cpu"


def test_the_network_policy_admits_only_the_pod_the_operator_and_monitoring():
    settings = OperatorSettings(network_policy=True, operator_namespace="orbit-system", learner_status_port=9400,
                                operator_pod_labels=(("app.kubernetes.io/component", "operator"),), monitoring_namespace="prom")  # fmt: skip
    policy = build_network_policy("qwen", "ml", settings)
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"orbit.dev/job": "qwen"}} and spec["policyTypes"] == ["Ingress"]
    own, operator, monitoring = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"orbit.dev/job": "qwen"}}}]}
    assert operator["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "orbit-system"}},
                                 "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}}}]  # fmt: skip
    assert operator["ports"] == [{"protocol": "TCP", "port": 9400}]  # the learner's /status, nothing else
    assert monitoring["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "prom"}
    assert sorted(p["port"] for p in monitoring["ports"]) == [8000, 8001, 9400]
    import kubernetes_validate

    kubernetes_validate.validate(policy, "1.32", strict=True)


def test_a_job_that_judges_code_gets_the_sandbox_profile_on_its_learner_only():
    """code_tests runs bwrap in the learner: its container (only) runs under the Localhost profile
    the chart ships, which allows user namespaces and mounts; every capability stays dropped and
    the pod still passes the policy."""
    job = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    job["spec"]["rewards"] = [{"function": "code_tests"}]
    settings = OperatorSettings(cache_root=CACHE_ROOT, sandbox_seccomp_profile="orbit/bwrap.json")
    pod = build_pod("code", "ml", validate_job(job).spec, settings, attempt=0)
    containers = {c["name"]: c for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]}
    assert containers["learner"]["securityContext"]["seccompProfile"] == {"type": "Localhost", "localhostProfile": "orbit/bwrap.json"}
    assert containers["learner"]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert all("seccompProfile" not in c["securityContext"] for name, c in containers.items() if name != "learner")
    assert "seccompProfile" not in next(c for c in operator_pod()["spec"]["containers"] if c["name"] == "learner")["securityContext"]
    assert refusals(_policy(), pod) == []
    profile = json.loads((ROOT / "charts" / "orbit" / "files" / "seccomp-bwrap.json").read_text())
    denied = {name for rule in profile["syscalls"] if rule["action"] != "SCMP_ACT_ALLOW" for name in rule["names"]}
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW" and not denied & {"unshare", "clone", "clone3", "mount", "pivot_root", "setns"}
    assert {"ptrace", "bpf", "kexec_load", "init_module", "perf_event_open"} <= denied
