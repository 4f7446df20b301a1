"""The operator's own configuration, from its environment (the Helm chart sets it).

The node cache root - where INT4 bases live on each node (a hostPath) - is configured here
and only here: a job never names a host path. Each base gets a directory under it whose name
the operator derives (a digest of the source, or a validated name), so no job can reach
outside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import PurePosixPath

from orbit_runtime.errors import OrbitError

DEFAULT_CACHE_ROOT = "/var/lib/orbit/bases"
RUNTIME_REPOSITORY = "ghcr.io/orbit-rl/orbit-runtime"
RUNTIME_USER = 10001  # the runtime images' user (images/runtime*/Dockerfile)
CACHE_MIN_IDLE_FLOOR_S = 300  # the least ORBIT_CACHE_MIN_IDLE_SECONDS (values.schema.json's cache.minIdleSeconds minimum too)


def _version() -> str:
    """Orbit's version (pyproject.toml, the one place that names it; the chart's appVersion equals it)."""
    try:
        return metadata.version("orbit")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0.0.0"


DEFAULT_IMAGE = f"{RUNTIME_REPOSITORY}:{_version()}"


@dataclass(frozen=True)
class OperatorSettings:
    cache_root: str = DEFAULT_CACHE_ROOT  # hostPath root of the node's base cache
    runtime_image: str = DEFAULT_IMAGE  # the roles' image unless a job overrides it per role
    namespaces: tuple[str, ...] = ()  # watched namespaces; empty: cluster-wide
    max_gpus_per_node: int = 8
    run_as_user: int = RUNTIME_USER  # the runtime image's non-root user; the cache root must be writable by it
    # the learner's seccomp profile (a Localhost profile on every node) when a job judges code in the bwrap
    # sandbox: RuntimeDefault refuses the user namespaces bwrap makes (docs/code-rewards.md)
    sandbox_seccomp_profile: str = "orbit/bwrap.json"
    status_poll_seconds: float = 10.0  # how often a running job is reconciled and its learner polled
    resync_seconds: float = 300.0  # how often any other job is reconciled when nothing about it changes
    reconcile_workers: int = 4  # reconciles run at once (of different jobs)
    learner_status_port: int = 9400
    allow_image_override: bool = False  # may a job set resources.<role>.image? (its learner gets the job's Secrets)
    backoff_base_seconds: float = 10.0  # first delay before a failed pod is replaced; doubles, at most 5 minutes
    # the GPU of the cluster's nodes, for jobs whose nodeSelector names none (nvidia.com/gpu.product): a name of
    # the planner's table (H100, H200, B200, MI300X) or one GPU's memory; unset: such jobs are planned by prepare-base
    node_gpu: str | None = None
    node_gpu_memory_gib: float | None = None
    extra_pod_env: dict[str, str] = field(default_factory=dict)
    # the node cache's size limit (GiB): set, every pod's `cache-cleanup` init container evicts least recently used
    # bases down to it, never one a pod started on within cache_min_idle_seconds; unset: no cleanup
    cache_max_gib: float | None = None
    cache_min_idle_seconds: float = 6 * 3600
    kueue: bool = False  # the operator is Kueue's job-framework controller for RLTrainingJob (kueue.py)
    # allowlists for what a job puts on its pod (validation.PodMetadataPolicy); empty: anything
    allowed_priority_classes: tuple[str, ...] = ()
    allowed_pod_labels: tuple[str, ...] = ()
    allowed_pod_annotations: tuple[str, ...] = ()
    # a NetworkPolicy per job (job_access.py): ingress only from the pod, the operator's pods and the monitoring namespace
    network_policy: bool = False
    operator_namespace: str = "orbit-system"  # where the operator runs (the chart: its release namespace)
    operator_pod_labels: tuple[tuple[str, str], ...] = ()  # the operator pods' labels (the chart's selector labels)
    monitoring_namespace: str | None = "monitoring"  # Prometheus' namespace; None: no scrapes allowed in

    def __post_init__(self) -> None:
        root = PurePosixPath(self.cache_root)
        if not root.is_absolute() or ".." in root.parts or str(root) == "/":
            raise OrbitError(f"ORBIT_CACHE_ROOT must be an absolute directory other than /, got {self.cache_root!r}")
        if min(self.status_poll_seconds, self.backoff_base_seconds, self.resync_seconds) <= 0:
            raise OrbitError("ORBIT_STATUS_POLL_SECONDS, ORBIT_BACKOFF_BASE_SECONDS and ORBIT_RESYNC_SECONDS must be > 0")
        if self.reconcile_workers < 1:
            raise OrbitError(f"ORBIT_RECONCILE_WORKERS must be >= 1, got {self.reconcile_workers}")
        if self.max_gpus_per_node < 1:
            raise OrbitError(f"ORBIT_MAX_GPUS_PER_NODE must be >= 1, got {self.max_gpus_per_node}")
        if self.node_gpu is not None:
            from orbit_runtime.plan.hardware import gpu_model

            try:
                gpu_model(self.node_gpu)
            except OrbitError as exc:
                raise OrbitError(f"ORBIT_NODE_GPU: {exc}") from None
        if self.node_gpu_memory_gib is not None and self.node_gpu_memory_gib <= 0:
            raise OrbitError(f"ORBIT_NODE_GPU_MEMORY_GIB must be > 0, got {self.node_gpu_memory_gib}")
        if self.cache_max_gib is not None and self.cache_max_gib <= 0:
            raise OrbitError(f"ORBIT_CACHE_MAX_GIB must be > 0 (unset: no cleanup), got {self.cache_max_gib}")
        if self.cache_min_idle_seconds < CACHE_MIN_IDLE_FLOOR_S:  # less: a base a pod is starting on (not yet leased) could go
            raise OrbitError(f"ORBIT_CACHE_MIN_IDLE_SECONDS must be >= {CACHE_MIN_IDLE_FLOOR_S} (a pod's start: prepare-base to its "
                             f"roles' leases), got {self.cache_min_idle_seconds}")  # fmt: skip

    def pod_metadata_policy(self):  # -> validation.PodMetadataPolicy (imported here: validation imports the job spec)
        """The allowlists for a job's priorityClassName, podLabels and podAnnotations."""
        from orbit_operator.validation import PodMetadataPolicy

        return PodMetadataPolicy(self.allowed_priority_classes, self.allowed_pod_labels, self.allowed_pod_annotations)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        """ORBIT_CACHE_ROOT, ORBIT_RUNTIME_IMAGE, ORBIT_NAMESPACES (comma-separated), ORBIT_MAX_GPUS_PER_NODE,
        ORBIT_RUN_AS_USER, ORBIT_STATUS_POLL_SECONDS, ORBIT_LEARNER_STATUS_PORT, ORBIT_BACKOFF_BASE_SECONDS,
        ORBIT_ALLOW_IMAGE_OVERRIDE, ORBIT_NODE_GPU, ORBIT_NODE_GPU_MEMORY_GIB, ORBIT_RESYNC_SECONDS,
        ORBIT_RECONCILE_WORKERS, ORBIT_CACHE_MAX_GIB, ORBIT_CACHE_MIN_IDLE_SECONDS,
        ORBIT_KUEUE, ORBIT_ALLOWED_PRIORITY_CLASSES, ORBIT_ALLOWED_POD_LABELS and
        ORBIT_ALLOWED_POD_ANNOTATIONS (comma-separated), ORBIT_NETWORK_POLICY, ORBIT_OPERATOR_NAMESPACE,
        ORBIT_OPERATOR_POD_LABELS (k=v,...), ORBIT_MONITORING_NAMESPACE."""
        env = dict(os.environ if env is None else env)

        def number(name: str, default, kind=int):
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return kind(raw)
            except ValueError:
                raise OrbitError(f"{name}: not a number: {raw!r}") from None

        def flag(name: str) -> bool:
            return env.get(name, "false").lower() in ("1", "true", "yes")

        def names(name: str) -> tuple[str, ...]:
            return tuple(n.strip() for n in env.get(name, "").split(",") if n.strip())

        return cls(
            cache_root=env.get("ORBIT_CACHE_ROOT", DEFAULT_CACHE_ROOT),
            runtime_image=env.get("ORBIT_RUNTIME_IMAGE", DEFAULT_IMAGE),
            namespaces=names("ORBIT_NAMESPACES"),
            max_gpus_per_node=number("ORBIT_MAX_GPUS_PER_NODE", 8),
            run_as_user=number("ORBIT_RUN_AS_USER", RUNTIME_USER),
            sandbox_seccomp_profile=env.get("ORBIT_SANDBOX_SECCOMP_PROFILE") or "orbit/bwrap.json",
            status_poll_seconds=number("ORBIT_STATUS_POLL_SECONDS", 10.0, float),
            resync_seconds=number("ORBIT_RESYNC_SECONDS", 300.0, float),
            reconcile_workers=number("ORBIT_RECONCILE_WORKERS", 4),
            learner_status_port=number("ORBIT_LEARNER_STATUS_PORT", 9400),
            backoff_base_seconds=number("ORBIT_BACKOFF_BASE_SECONDS", 10.0, float),
            allow_image_override=flag("ORBIT_ALLOW_IMAGE_OVERRIDE"),
            node_gpu=env.get("ORBIT_NODE_GPU") or None,
            kueue=flag("ORBIT_KUEUE"),
            node_gpu_memory_gib=number("ORBIT_NODE_GPU_MEMORY_GIB", None, float),
            cache_max_gib=number("ORBIT_CACHE_MAX_GIB", None, float),
            cache_min_idle_seconds=number("ORBIT_CACHE_MIN_IDLE_SECONDS", 6 * 3600.0, float),
            allowed_priority_classes=names("ORBIT_ALLOWED_PRIORITY_CLASSES"),
            allowed_pod_labels=names("ORBIT_ALLOWED_POD_LABELS"),
            allowed_pod_annotations=names("ORBIT_ALLOWED_POD_ANNOTATIONS"),
            network_policy=flag("ORBIT_NETWORK_POLICY"),
            operator_namespace=env.get("ORBIT_OPERATOR_NAMESPACE") or "orbit-system",
            operator_pod_labels=tuple(tuple(p.split("=", 1)) for p in names("ORBIT_OPERATOR_POD_LABELS") if "=" in p),  # type: ignore[misc]
            monitoring_namespace=env.get("ORBIT_MONITORING_NAMESPACE", "monitoring") or None,
        )
