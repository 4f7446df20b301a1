"""The pod (and its ConfigMap) an RLTrainingJob becomes. Pure functions: no API calls.

One pod on one node:

- init container `prepare-base`: quantizes or verifies the base into the node's cache
  (hostPath under the operator's cache root, in a directory the operator names: a digest of
  the job's namespace and source, or `named/<nodeCache>` for a base an administrator put
  there). It sees only that directory, and is the only writer; the base itself is its
  `model/` subdirectory, which the roles mount read-only. It reuses a base only while the
  source's fingerprint matches the one recorded with it (orbit_runtime.base_cache).
- init container `cache-cleanup`, first, only when the operator has a cache size limit
  (ORBIT_CACHE_MAX_GIB): `orbit cache-cleanup` on the whole cache root, evicting least recently
  used bases other than this job's (orbit_runtime.cache_cleanup); no Secret, no network use.
- `rollout` (vLLM: `orbit rollout`) and, with `reference.mode: server`, `reference`
  (`orbit reference`, on its own GPUs if it has any, else the CPU): native sidecars (init containers with
  `restartPolicy: Always`). They start before the learner, the kubelet restarts them in
  place when they crash (the learner waits, re-syncs, continues), and they stop when the
  learner ends - so the pod's outcome is the learner's.
- `learner`: the RL loop. The pod never restarts it (`restartPolicy: Never`): a learner
  that fails fails the pod, and the operator starts a new pod that resumes from the last
  checkpoint, with backoff.

The base is mounted read-only in the three roles, with the `base-id` emptyDir where prepare-base
wrote the digest it prepared (a role refuses to start on another base: orbit_runtime.base_lease);
adapters go through an emptyDir the learner writes and the rollout reads; /dev/shm is a memory emptyDir; the job config is a
ConfigMap (which also records the spec the pod was built from); S3 credentials (a Secret)
reach the learner only (a base's own `credentialsSecret`, prepare-base only). File data is
read from the base's PVC, mounted read-only in the learner at /data. Every container runs
as non-root with a read-only root filesystem, no privilege escalation and no capabilities.

Every role binds to the pod IP (downward API `status.podIP`), which is also how they reach
each other (`orbit learner --host <pod IP>` finds the rollout at port 8000 and the reference
at 8001 of that address, bracketed for IPv6): the kubelet's probes, Prometheus and the operator's `/status` poll all use the
pod IP, and two pods sharing one network namespace (the end-to-end test node) never clash.
The cost: `kubectl port-forward` (which dials localhost inside the pod) does not reach them.

Every role checks the job's API key (ORBIT_API_KEY, from the Secret job_access.py describes) on all
routes but the probes' and Prometheus'; the learner sends it. A container that requests no GPU gets
NVIDIA_VISIBLE_DEVICES=void, so the runtime image's default cannot show it the node's GPUs.

A hostPath volume is refused by Pod Security's baseline and restricted levels; everything else in
the pod meets `restricted`. docs/pod-security.md says how to keep the namespace at those levels
(an exemption for the operator plus the chart's admission policy).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from orbit_operator.crd import GROUP, KIND, VERSION
from orbit_operator.fit import plan_request
from orbit_operator.job_spec import RLTrainingJobSpec, RoleResources
from orbit_operator.settings import OperatorSettings
from orbit_runtime.api_key import API_KEY_ENV
from orbit_runtime.base_lease import BASE_ID_DIR, BASE_ID_FILE
from orbit_runtime.errors import OrbitError

BASE_MOUNT = "/base"  # the INT4 base, read-only, in every role
CACHE_MOUNT = "/cache"  # this base's cache directory in prepare-base; the whole root in cache-cleanup
SOURCE_MOUNT = "/source"  # a PVC-held source checkpoint, read-only, in prepare-base only
BASE_ID_MOUNT = BASE_ID_DIR  # the digest prepare-base prepared (emptyDir): the roles refuse another base
ADAPTERS_MOUNT = "/adapters"
CONFIG_MOUNT = "/etc/orbit"
RUN_MOUNT = "/var/run/orbit"  # the learner's run directory (metrics.jsonl, report, staging)
DATA_MOUNT = "/data"  # the base's PVC, read-only, in the learner (file data)
CONFIG_FILE = "job.yaml"
PLAN_FILE = "plan.json"  # the job's plan request (orbit_operator.fit): prepare-base plans the pod with the base's config.json
TERMINATION_LOG = "/dev/termination-log"  # the learner's final /status, read by the operator from the pod status
APPLIED_SPEC_FILE = "spec.json"  # the RLTrainingJob spec the job's pods are built from
SHARE_DIR_ENV = "ORBIT_SHARE_DIR"  # orbit_runtime.shared_base.transport reads it (that module pulls in torch)
PORTS = {"rollout": 8000, "reference": 8001}  # `orbit learner` finds them there; its own is the operator's learner_status_port
LABEL_JOB = f"{GROUP}/job"
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_ROLE = f"{GROUP}/component"


def base_cache_dir(spec: RLTrainingJobSpec, namespace: str) -> str:
    """The base's directory under the cache root: a digest of the namespace and the source, or
    `named/<nodeCache>` (an administrator's base, shared by every namespace).

    Never user text as a path: a digest is hex, and a nodeCache name is a validated DNS label.
    The namespace is in the digest: a PVC called `models` in another namespace, or an S3 URI
    another tenant cannot read, never maps to this job's copy. So is the credentialsSecret: two
    jobs of one namespace whose Secrets name other endpoints or credentials never share one.
    """
    base = spec.base
    if base.nodeCache is not None:
        return f"named/{base.nodeCache}"
    source = {"namespace": namespace, "format": base.format, "groupSize": base.groupSize, "uri": base.uri,
              "pvc": base.pvc.model_dump() if base.pvc else None, "credentialsSecret": base.credentialsSecret}  # fmt: skip
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:20]
    return f"base-{digest}"


def object_names(job_name: str, attempt: int) -> dict[str, str]:
    """Deterministic names: an operator restarted mid-reconcile finds what it created, never a duplicate."""
    return {"pod": f"{job_name}-{attempt}", "configmap": f"{job_name}-config", "api_key_secret": f"{job_name}-api-key",
            "network_policy": f"{job_name}-ingress"}  # fmt: skip


API_KEY_FIELD = "api-key"  # the key of the job's API key Secret (job_access.py)


def _api_key_env(job_name: str) -> dict:
    """ORBIT_API_KEY from the job's Secret: the serving roles check it, the learner sends it (orbit_runtime.api_key)."""
    secret = {"name": object_names(job_name, 0)["api_key_secret"], "key": API_KEY_FIELD}
    return {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": secret}}


def runtime_config(spec: RLTrainingJobSpec, settings: OperatorSettings) -> dict:
    """The `orbit learner` config in the ConfigMap: the job's runtime sections, the base at its
    mount, file data under the data mount."""
    runtime = spec.runtime_spec(base_path=BASE_MOUNT, output_dir=RUN_MOUNT)
    data = runtime.model_dump(mode="json")
    for key in ("path", "validation_path"):
        if data["data"].get(key):
            data["data"][key] = f"{DATA_MOUNT}/{data['data'][key]}"
    data["metrics"] = {"port": settings.learner_status_port, "host": "0.0.0.0"}
    return data


# spec.json's format: 1 since the key exists; none (0) in ConfigMaps written before. applied_spec() reads every
# version listed here (an old operator's ConfigMap outlives an upgrade: a running job keeps its applied spec)
APPLIED_SPEC_VERSION_FILE = "spec-version"
APPLIED_SPEC_VERSION = 1
APPLIED_SPEC_VERSIONS = (0, 1)  # 0 and 1: the same JSON (RLTrainingJobSpec's dump); a later change adds a migration


def build_configmap(name: str, namespace: str, spec: RLTrainingJobSpec, settings: OperatorSettings) -> dict:
    names = object_names(name, 0)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": names["configmap"], "namespace": namespace, "labels": job_labels(name)},
        "data": {
            CONFIG_FILE: yaml.safe_dump(runtime_config(spec, settings), sort_keys=True),
            APPLIED_SPEC_FILE: json.dumps(spec.model_dump(mode="json"), sort_keys=True),
            APPLIED_SPEC_VERSION_FILE: str(APPLIED_SPEC_VERSION),
            **({PLAN_FILE: plan} if (plan := _plan_json(spec, settings)) else {}),
        },
    }


def _plan_json(spec: RLTrainingJobSpec, settings: OperatorSettings) -> str | None:
    """The job's plan request for prepare-base; None if it cannot be made (the planner never stops a pod:
    prepare-base then warns that the job was not planned)."""
    try:
        return plan_request(spec, settings).model_dump_json()
    except (OrbitError, ValueError):
        return None


def applied_spec(configmap: dict | None) -> RLTrainingJobSpec | None:
    """The spec the job's pods are built from (None: no ConfigMap yet, or unreadable: a version this operator
    does not know, or a spec that does not parse), whichever operator version wrote it (APPLIED_SPEC_VERSIONS)."""
    if not configmap:
        return None
    data = configmap.get("data") or {}
    version = str(data.get(APPLIED_SPEC_VERSION_FILE, "0")).strip()
    if not version.isdigit() or int(version) not in APPLIED_SPEC_VERSIONS:
        return None
    try:
        return RLTrainingJobSpec.model_validate_json(data.get(APPLIED_SPEC_FILE, ""))
    except ValueError:
        return None


def job_labels(job_name: str, **extra: str) -> dict[str, str]:
    """The labels on every object the operator makes for a job (its pods add the attempt)."""
    return {"app.kubernetes.io/name": "orbit", "app.kubernetes.io/managed-by": "orbit-operator", LABEL_JOB: job_name, **extra}


def _resources(role: RoleResources) -> dict:
    amounts: dict[str, Any] = {"cpu": role.cpu, "memory": role.memory}
    if role.gpus:
        amounts["nvidia.com/gpu"] = str(role.gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def judges_code(spec: RLTrainingJobSpec) -> bool:
    """Whether the job's learner runs programs in the bwrap sandbox (the built-in code_tests reward)."""
    return any(reward.function == "code_tests" for reward in spec.rewards)


def _security_context() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _probes(port_name: str, startup_seconds: int, path: str) -> dict:
    """Startup (generous: loading a model), then readiness and liveness on the role's health route."""
    get = {"httpGet": {"path": path, "port": port_name}}
    return {
        "startupProbe": {**get, "periodSeconds": 10, "failureThreshold": max(1, startup_seconds // 10), "timeoutSeconds": 5},
        "readinessProbe": {**get, "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5},
        "livenessProbe": {**get, "periodSeconds": 20, "failureThreshold": 6, "timeoutSeconds": 10},
    }


POD_IP_ENV = "ORBIT_POD_IP"  # the pod's IP (downward API); every role binds to it


def _env(settings: OperatorSettings, role: str) -> list[dict]:
    """The roles' environment: the pod IP (downward API) first, so later values could refer to $(ORBIT_POD_IP)."""
    env = {
        "HOME": "/tmp",
        "XDG_CACHE_HOME": "/tmp/.cache",
        "HF_HUB_OFFLINE": "1",
        "ORBIT_ROLE": role,
        "ORBIT_CONFIG": f"{CONFIG_MOUNT}/{CONFIG_FILE}",
        "ORBIT_BASE_DIR": BASE_MOUNT,
        "ORBIT_ADAPTERS_DIR": ADAPTERS_MOUNT,
        **settings.extra_pod_env,
    }
    pod_ip = {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    return [pod_ip, *({"name": k, "value": v} for k, v in env.items())]


def _container(name: str, image: str, command: list[str], settings: OperatorSettings, role: RoleResources,
               mounts: list[dict]) -> dict:  # fmt: skip
    return {
        "name": name,
        "image": role.image or image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        # a container that requests no GPU must not see the node's GPUs through the NVIDIA runtime's default
        # (the CUDA images set NVIDIA_VISIBLE_DEVICES=all): `void` hides them all
        "env": [*_env(settings, name), *([] if role.gpus else [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}])],
        "resources": _resources(role),
        "securityContext": _security_context(),
        "volumeMounts": [{"name": f"tmp-{name}", "mountPath": "/tmp"}, *mounts],
    }


def _cleanup_container(cache_dir: str, image: str, settings: OperatorSettings) -> dict:
    """`orbit cache-cleanup`, before prepare-base when the operator has a cache size limit: the one container
    that mounts the whole cache root (read-write), to evict other bases; no Secret, no ConfigMap, no network use."""
    assert settings.cache_max_gib is not None
    command = ["orbit", "cache-cleanup", "--root", CACHE_MOUNT, "--max-bytes", str(int(settings.cache_max_gib * (1 << 30))),
               "--keep", cache_dir, "--min-idle-seconds", str(int(settings.cache_min_idle_seconds)),
               "--termination-log", TERMINATION_LOG]  # fmt: skip
    container = _container("cache-cleanup", image, command, settings, RoleResources(cpu="500m", memory="512Mi"),
                           [{"name": "base-cache", "mountPath": CACHE_MOUNT}])  # fmt: skip
    container.update(terminationMessagePath=TERMINATION_LOG, terminationMessagePolicy="FallbackToLogsOnError")
    return container


def build_pod(name: str, namespace: str, spec: RLTrainingJobSpec, settings: OperatorSettings, attempt: int = 0,
              enforce_fit: bool = False) -> dict:  # fmt: skip
    """The pod of attempt ATTEMPT (0, then one more per pod failure) of job NAME. ENFORCE_FIT (the job's
    first start): prepare-base fails the pod with DoesNotFit when the plan says the job cannot fit."""
    names = object_names(name, attempt)
    cache_dir = base_cache_dir(spec, namespace)
    base_ro = {"name": "base-cache", "mountPath": BASE_MOUNT, "subPath": f"{cache_dir}/model", "readOnly": True}
    base_id_ro = {"name": "base-id", "mountPath": BASE_ID_MOUNT, "readOnly": True}
    config = {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}
    image, res = settings.runtime_image, spec.resources

    # prepare-base sees only this job's cache directory (read-only for an administrator's named base)
    prepare_mounts = [{"name": "base-cache", "mountPath": CACHE_MOUNT, "subPath": cache_dir,
                       **({"readOnly": True} if spec.base.nodeCache else {})}, config,
                      {"name": "base-id", "mountPath": BASE_ID_MOUNT}]  # fmt: skip
    prepare = ["orbit", "prepare-base", "--cache", CACHE_MOUNT, "--format", spec.base.format,
               "--group-size", str(spec.base.groupSize), "--plan", f"{CONFIG_MOUNT}/{PLAN_FILE}",
               "--termination-log", TERMINATION_LOG, "--base-id", str(BASE_ID_FILE),
               *(["--enforce-fit"] if enforce_fit else [])]  # fmt: skip
    if spec.base.pvc is not None:
        prepare_mounts.append({"name": "base-source", "mountPath": SOURCE_MOUNT, "subPath": spec.base.pvc.subPath,
                               "readOnly": True})  # fmt: skip
        prepare += ["--source", SOURCE_MOUNT]
    elif spec.base.uri is not None:
        prepare += ["--source", spec.base.uri]
    init = _container("prepare-base", image, prepare, settings, RoleResources(cpu="2", memory="8Gi"), prepare_mounts)
    if spec.base.credentialsSecret:
        init["envFrom"] = [{"secretRef": {"name": spec.base.credentialsSecret}}]  # the base's S3 source: prepare-base only
    # its plan (a one-line summary, or DoesNotFit with the breakdown) as JSON, or the end of its log if it failed otherwise
    init.update(terminationMessagePath=TERMINATION_LOG, terminationMessagePolicy="FallbackToLogsOnError")
    cleanup = [_cleanup_container(cache_dir, image, settings)] if settings.cache_max_gib is not None else []

    config_file, bind = f"{CONFIG_MOUNT}/{CONFIG_FILE}", ["--host", f"$({POD_IP_ENV})"]
    rollout = _container("rollout", image, ["orbit", "rollout", config_file, *bind], settings, res.rollout,
                         [base_ro, base_id_ro, config, {"name": "adapters", "mountPath": ADAPTERS_MOUNT, "readOnly": True},
                          {"name": "dshm", "mountPath": "/dev/shm"}])  # fmt: skip
    reference_device = "cuda" if res.reference.gpus else "cpu"  # its own GPUs, not the learner's
    reference = _container("reference", image, ["orbit", "reference", config_file, *bind, "--device", reference_device],
                           settings, res.reference, [base_ro, base_id_ro, config])  # fmt: skip
    # the learner waits for a restarting role at least as long as the role's startup probe allows
    learner = _container("learner", image, ["orbit", "learner", config_file, *bind, "--wait-seconds", "2100", "--termination-log",
                                            TERMINATION_LOG], settings, res.learner,
                         [base_ro, base_id_ro, config, {"name": "adapters", "mountPath": ADAPTERS_MOUNT},
                          {"name": "run", "mountPath": RUN_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}])  # fmt: skip
    # the final /status (JSON) or, when the learner fails, the end of its log: the operator reads it from the pod
    learner.update(terminationMessagePath=TERMINATION_LOG, terminationMessagePolicy="FallbackToLogsOnError")
    if judges_code(spec):  # bwrap makes user namespaces, which RuntimeDefault refuses; still no capability
        learner["securityContext"]["seccompProfile"] = {"type": "Localhost", "localhostProfile": settings.sandbox_seccomp_profile}
    if spec.base.pvc is not None:
        learner["volumeMounts"].append({"name": "base-source", "mountPath": DATA_MOUNT, "readOnly": True})
    ports = {**PORTS, "learner": settings.learner_status_port}
    # vLLM's health route is /health; Orbit's roles serve /healthz
    server_reference = spec.reference.mode == "server"  # shared: the learner computes it, no container
    roles = [(rollout, 1800, "/health"), *([(reference, 900, "/healthz")] if server_reference else []), (learner, 1800, "/healthz")]
    for container, startup, path in roles:
        container["ports"] = [{"name": container["name"][:15], "containerPort": ports[container["name"]], "protocol": "TCP"}]
        container.update(_probes(container["name"][:15], startup, path))
    for sidecar in (rollout, reference):
        sidecar["restartPolicy"] = "Always"  # a native sidecar: restarted in place, stopped after the learner
    for role in (rollout, reference, learner):  # the run's API key: the servers ask for it, the learner sends it
        role["env"].append(_api_key_env(name))
    if spec.placement == "colocated":
        # the learner maps the rollout's base: its socket goes in the /dev/shm volume both containers mount
        learner["env"].append({"name": SHARE_DIR_ENV, "value": "/dev/shm"})
    learner_secrets = [name for name in (spec.checkpoint.credentialsSecret, spec.run.trackingSecret) if name]
    if learner_secrets:  # S3 and tracker credentials: the learner only
        learner["envFrom"] = [{"secretRef": {"name": name}} for name in dict.fromkeys(learner_secrets)]

    volumes: list[dict] = [
        {"name": "base-cache", "hostPath": {"path": settings.cache_root, "type": "DirectoryOrCreate"}},
        {"name": "config", "configMap": {"name": names["configmap"]}},
        {"name": "adapters", "emptyDir": {}},
        {"name": "run", "emptyDir": {}},
        {"name": "base-id", "emptyDir": {"sizeLimit": "1Mi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *({"name": f"tmp-{c['name']}", "emptyDir": {}}
          for c in (*cleanup, init, rollout, *([reference] if server_reference else []), learner)),
    ]
    if spec.base.pvc is not None:
        volumes.append({"name": "base-source", "persistentVolumeClaim": {"claimName": spec.base.pvc.claimName, "readOnly": True}})

    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "initContainers": [*cleanup, init, rollout, *([reference] if server_reference else [])],
        "containers": [learner],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "fsGroup": settings.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,  # the roles never talk to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": int(spec.checkpoint.stop_timeout_s) + 30,  # time for the last checkpoint
    }
    if spec.nodeSelector:
        pod_spec["nodeSelector"] = dict(spec.nodeSelector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    if spec.priorityClassName:
        pod_spec["priorityClassName"] = spec.priorityClassName
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": names["pod"],
            "namespace": namespace,
            "labels": {**spec.podLabels, **job_labels(name, **{LABEL_ATTEMPT: str(attempt)})},
            "annotations": {**spec.podAnnotations, f"{GROUP}/restart-id": spec.restartId},
        },
        "spec": pod_spec,
    }


def owner_reference(name: str, uid: str) -> dict:
    """What makes the job own (and garbage-collect) a pod or ConfigMap."""
    # no blockOwnerDeletion: it would need `update` on rltrainingjobs/finalizers where the
    # OwnerReferencesPermissionEnforcement admission plugin runs (OpenShift), for nothing the operator uses
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid, "controller": True}
