"""Will a job fit its node? The operator's side of `orbit plan`: pure functions.

The operator cannot read the base (a PVC, S3 behind the job's Secret, the node cache), so
it plans from what the job says: `base.architecture` (a catalog model) or `base.modelConfig`
(an inline config.json), the job's sections, its pod's resources, and the node's GPU, from
the GPU product the job's nodeSelector names (`nvidia.com/gpu.product`) or the operator's
configuration (ORBIT_NODE_GPU / ORBIT_NODE_GPU_MEMORY_GIB). Node objects are never read: that
needs cluster-wide RBAC the namespaced chart mode does not grant.

`plan_request` is also written into the job's ConfigMap (`plan.json`): prepare-base plans
the same request with the base's real config.json.
"""

from __future__ import annotations

from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_operator.quantity import parse_quantity
from orbit_operator.settings import OperatorSettings
from orbit_runtime.plan.architecture import Architecture, parse_architecture
from orbit_runtime.plan.catalog import catalog_architecture
from orbit_runtime.plan.hardware import GIB, gpu_from_node_selector
from orbit_runtime.plan.job_fit import JobFit, fit_job
from orbit_runtime.plan.request import ROLES, NodeSpec, PlanRequest, RoleBudget, from_job_spec


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (64Gi, 500M, 1.5e9) in bytes."""
    return int(parse_quantity(quantity))


def node_spec(spec: RLTrainingJobSpec, settings: OperatorSettings) -> NodeSpec:
    """The node's GPUs as the operator can know them (gpu None and no memory: unknown)."""
    gpus = sum(getattr(spec.resources, role).gpus for role in ROLES)
    if gpus == 0:
        return NodeSpec(gpus=0)
    count = settings.max_gpus_per_node
    from_selector = gpu_from_node_selector(spec.nodeSelector)
    if from_selector is not None:
        return NodeSpec(gpus=count, gpu=from_selector.name)
    if settings.node_gpu:
        return NodeSpec(gpus=count, gpu=settings.node_gpu)
    if settings.node_gpu_memory_gib:
        return NodeSpec(gpus=count, gpu_memory_bytes=int(settings.node_gpu_memory_gib * GIB))
    return NodeSpec(gpus=count)


def plan_request(spec: RLTrainingJobSpec, settings: OperatorSettings) -> PlanRequest:
    """The plan request of the job's pod: its sections, its containers' GPUs and memory limits, its node."""
    roles = {role: RoleBudget(gpus=getattr(spec.resources, role).gpus, memory_bytes=memory_bytes(getattr(spec.resources, role).memory))
             for role in ROLES}  # fmt: skip
    return from_job_spec(spec, group_size=spec.base.groupSize, node=node_spec(spec, settings), roles=roles)


def job_architecture(spec: RLTrainingJobSpec) -> Architecture | None:
    """The architecture the job names (base.architecture or base.modelConfig), or None."""
    if spec.base.architecture:
        return catalog_architecture(spec.base.architecture)
    if spec.base.modelConfig is not None:
        return parse_architecture(spec.base.modelConfig, "spec.base.modelConfig")
    return None


def admission_fit(spec: RLTrainingJobSpec, settings: OperatorSettings) -> JobFit | None:
    """The job's fit before any pod exists, or None when the job names no architecture."""
    arch = job_architecture(spec)
    if arch is None:
        return None
    return fit_job(arch, plan_request(spec, settings))
