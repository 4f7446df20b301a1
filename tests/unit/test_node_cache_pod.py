"""The node cache's size limit, operator side: the setting (environment, chart values) adds a
`cache-cleanup` init container before prepare-base, the only container that mounts the whole cache
root, with no Secret, no ConfigMap and the same hardening as the others; unset, the pod is as before."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from orbit_operator.pod import CACHE_MOUNT, base_cache_dir, build_pod
from orbit_operator.settings import OperatorSettings
from orbit_operator.validation import validate_job
from orbit_runtime.base_lease import BASE_ID_DIR, BASE_ID_FILE
from orbit_runtime.errors import OrbitError

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "orbit"


def _spec(**base):
    job = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    if base:  # another source instead of the example's PVC (file data is on that PVC: synthetic data then)
        job["spec"]["base"] = {**{k: v for k, v in job["spec"]["base"].items() if k != "pvc"}, **base}
        job["spec"]["data"] = {"type": "synthetic_arithmetic"}
    check = validate_job(job, "test")
    assert check.ok, check.errors
    return check.spec


def _deployment_env(values: dict | None) -> dict[str, str]:
    manifests = helm.Chart.load(CHART).render(values, name="orbit", namespace="orbit-system")
    docs = [d for path, text in manifests.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_with_a_limit_cache_cleanup_runs_first_and_alone_sees_the_whole_root():
    spec = _spec(uri="s3://models/qwen", credentialsSecret="s3-creds")
    settings = OperatorSettings(cache_max_gib=200, cache_min_idle_seconds=7200)
    pod = build_pod("job", "team-a", spec, settings)
    kubernetes_validate.validate(pod, "1.32", strict=True)
    cleanup, prepare, *_ = pod["spec"]["initContainers"]
    assert (cleanup["name"], prepare["name"]) == ("cache-cleanup", "prepare-base")
    assert cleanup["command"] == ["orbit", "cache-cleanup", "--root", CACHE_MOUNT, "--max-bytes", str(200 << 30),
                                  "--keep", base_cache_dir(spec, "team-a"), "--min-idle-seconds", "7200",
                                  "--termination-log", "/dev/termination-log"]  # fmt: skip
    assert cleanup["image"] == settings.runtime_image and "restartPolicy" not in cleanup  # runs to completion, first
    # no Secret (prepare-base has the base's), no ConfigMap, nothing but /tmp and the cache root
    assert "envFrom" not in cleanup and prepare["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert not any("valueFrom" in e and "secretKeyRef" in e["valueFrom"] for e in cleanup["env"])
    assert {m["name"]: m for m in cleanup["volumeMounts"]}["base-cache"] == {"name": "base-cache", "mountPath": CACHE_MOUNT}
    assert {m["name"] for m in cleanup["volumeMounts"]} == {"base-cache", "tmp-cache-cleanup"}
    whole_root = [(c["name"], m) for c in pod["spec"]["initContainers"] + pod["spec"]["containers"] for m in c["volumeMounts"]
                  if m["name"] == "base-cache" and "subPath" not in m]  # fmt: skip
    assert [name for name, _ in whole_root] == ["cache-cleanup"]  # every other container: its own directory, by subPath
    assert cleanup["securityContext"] == prepare["securityContext"]
    assert cleanup["securityContext"]["runAsNonRoot"] and cleanup["securityContext"]["readOnlyRootFilesystem"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] and pod["spec"]["securityContext"]["runAsUser"] == settings.run_as_user
    assert {"name": "tmp-cache-cleanup", "emptyDir": {}} in pod["spec"]["volumes"]


def test_without_a_limit_the_pod_has_no_cleanup():
    pod = build_pod("job", "team-a", _spec(), OperatorSettings())
    assert [c["name"] for c in pod["spec"]["initContainers"]][0] == "prepare-base"
    assert not any(v["name"] == "tmp-cache-cleanup" for v in pod["spec"]["volumes"])


def test_an_administrators_base_is_kept_by_name():
    pod = build_pod("job", "team-a", _spec(nodeCache="llama-70b", format="int4"), OperatorSettings(cache_max_gib=1.5))
    cleanup = pod["spec"]["initContainers"][0]
    assert cleanup["command"][cleanup["command"].index("--keep") + 1] == "named/llama-70b"
    assert cleanup["command"][cleanup["command"].index("--max-bytes") + 1] == str(int(1.5 * (1 << 30)))


def test_the_settings_come_from_the_environment_and_bad_values_name_the_variable():
    settings = OperatorSettings.from_env({"ORBIT_CACHE_MAX_GIB": "500", "ORBIT_CACHE_MIN_IDLE_SECONDS": "300"})
    assert (settings.cache_max_gib, settings.cache_min_idle_seconds) == (500.0, 300.0)
    assert OperatorSettings.from_env({}).cache_max_gib is None and OperatorSettings.from_env({}).cache_min_idle_seconds == 21600
    for env, name in [({"ORBIT_CACHE_MAX_GIB": "0"}, "ORBIT_CACHE_MAX_GIB"), ({"ORBIT_CACHE_MAX_GIB": "lots"}, "ORBIT_CACHE_MAX_GIB"),
                      ({"ORBIT_CACHE_MIN_IDLE_SECONDS": "-1"}, "ORBIT_CACHE_MIN_IDLE_SECONDS"),
                      ({"ORBIT_CACHE_MIN_IDLE_SECONDS": "60"}, "ORBIT_CACHE_MIN_IDLE_SECONDS must be >= 300")]:  # fmt: skip
        with pytest.raises(OrbitError, match=name):
            OperatorSettings.from_env(env)


def test_the_chart_sets_the_limit_only_when_given():
    default = OperatorSettings.from_env(_deployment_env(None))
    assert default.cache_max_gib is None and default.cache_min_idle_seconds == 21600
    limited = OperatorSettings.from_env(_deployment_env({"cache": {"maxSizeGiB": 750, "minIdleSeconds": 3600}}))
    assert (limited.cache_max_gib, limited.cache_min_idle_seconds) == (750.0, 3600.0)
    for bad, where in [({"maxSizeGiB": 0}, "maxSizeGiB"), ({"maxSizeGiB": "big"}, "maxSizeGiB"), ({"minIdleSeconds": -5}, "minIdleSeconds"),
                       ({"minIdleSeconds": 299}, "minIdleSeconds"),
                       ({"maxSize": 5}, "additional properties")]:  # fmt: skip
        with pytest.raises(helm.HelmValuesError) as refused:
            _deployment_env({"cache": bad})
        assert where in str(refused.value), str(refused.value)


def test_two_secrets_for_one_uri_get_two_directories():
    """The same URI through two Secrets (another endpoint, other credentials) in one namespace: two directories."""
    first, second = _spec(uri="s3://models/qwen", credentialsSecret="s3-a"), _spec(uri="s3://models/qwen", credentialsSecret="s3-b")
    assert base_cache_dir(first, "team-a") != base_cache_dir(second, "team-a")
    assert base_cache_dir(first, "team-a") == base_cache_dir(_spec(uri="s3://models/qwen", credentialsSecret="s3-a"), "team-a")
    assert base_cache_dir(first, "team-a") != base_cache_dir(_spec(uri="s3://models/qwen"), "team-a")


def test_prepare_base_tells_the_roles_which_base_it_prepared():
    """A base-id emptyDir: prepare-base writes the digest into it (--base-id), every role mounts it read-only
    and refuses to start on another base (orbit_runtime.base_lease.check_base_identity)."""
    pod = build_pod("job", "team-a", _spec(uri="s3://models/qwen", credentialsSecret="s3-creds"), OperatorSettings(cache_max_gib=10))
    kubernetes_validate.validate(pod, "1.32", strict=True)
    assert {"name": "base-id", "emptyDir": {"sizeLimit": "1Mi"}} in pod["spec"]["volumes"]
    containers = {c["name"]: c for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]}
    mounts = {name: [m for m in c["volumeMounts"] if m["name"] == "base-id"] for name, c in containers.items()}
    assert mounts["prepare-base"] == [{"name": "base-id", "mountPath": BASE_ID_DIR}]  # the one writer
    for role in ("rollout", "reference", "learner"):
        assert mounts[role] == [{"name": "base-id", "mountPath": BASE_ID_DIR, "readOnly": True}], role
    assert mounts["cache-cleanup"] == []
    command = containers["prepare-base"]["command"]
    assert command[command.index("--base-id") + 1] == str(BASE_ID_FILE) and BASE_ID_FILE.parent == Path(BASE_ID_DIR)
