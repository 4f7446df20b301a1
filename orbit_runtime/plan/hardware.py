"""GPUs the planner knows, and the node a job runs on.

Memory per GPU is what the driver reports as total (nvidia-smi / rocm-smi), which is a
little below the marketing capacity. The planner assumes 95% of it is usable by Orbit's
processes: the CUDA context, cuBLAS/NCCL workspaces and vLLM's forward scratch are rows
of the plan of their own, and the last 5% are left to the driver and to allocator
fragmentation (vLLM's own default, gpu_memory_utilization 0.9, keeps 10% free).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from orbit_runtime.plan.architecture import PlanError

GIB = 2**30
USABLE_SHARE = 0.95


def gib(value: int | float | None) -> str:
    """Bytes as GiB for people: one decimal, thousands separated; '' for nothing."""
    return "" if not value else f"{value / GIB:,.1f}"


@dataclass(frozen=True)
class GpuModel:
    name: str
    marketed: str  # the vendor's capacity, for people
    visible_bytes: int  # total memory as the driver reports it
    labels: tuple[str, ...]  # node label values (NVIDIA GPU feature discovery `nvidia.com/gpu.product`, AMD's `amd.com/gpu.product-name`)

    @property
    def usable_bytes(self) -> int:
        return int(self.visible_bytes * USABLE_SHARE)


GPUS = {
    gpu.name: gpu
    for gpu in (
        GpuModel("H100", "80 GB HBM3 (H100 SXM)", 81559 * 2**20, ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-SXM5-80GB")),
        GpuModel("H200", "141 GB HBM3e (H200 SXM)", 143771 * 2**20, ("NVIDIA-H200", "NVIDIA-H200-141GB-HBM3e")),
        GpuModel("B200", "180 GB HBM3e (DGX/HGX B200)", 183359 * 2**20, ("NVIDIA-B200",)),
        GpuModel("MI300X", "192 GB HBM3", 196288 * 2**20, ("AMD_Instinct_MI300X", "AMD_Instinct_MI300X_OAM")),
    )
}
ALIASES = {"H100-80GB": "H100", "H100-SXM": "H100", "H200-141GB": "H200", "B200-180GB": "B200", "MI300X-192GB": "MI300X"}
PRODUCT_LABELS = ("nvidia.com/gpu.product", "amd.com/gpu.product-name")


def gpu_model(name: str) -> GpuModel:
    """A GPU by table name (H100, H200, B200, MI300X; case-insensitive) or node label value."""
    key = name.strip()
    for candidate in (key, key.upper(), ALIASES.get(key.upper(), "")):
        if candidate in GPUS:
            return GPUS[candidate]
    found = gpu_from_label(key)
    if found is None:
        raise PlanError(f"GPU {name!r} is not in the planner's table ({', '.join(GPUS)}); give its memory with --gpu-memory-gib")
    return found


def gpu_from_label(value: str) -> GpuModel | None:
    """The GPU a product label names; None for an unknown product or a MIG slice (a fraction of a GPU)."""
    if re.search(r"MIG|SHARED", value, re.IGNORECASE):
        return None
    normal = value.upper().replace("_", "-")
    for gpu in GPUS.values():
        if any(normal == label.upper().replace("_", "-") for label in gpu.labels):
            return gpu
    return None


def gpu_from_node_selector(selector: dict[str, str]) -> GpuModel | None:
    """The GPU a job's nodeSelector pins (nvidia.com/gpu.product or amd.com/gpu.product-name), if known."""
    for key in PRODUCT_LABELS:
        if key in selector:
            return gpu_from_label(selector[key])
    return None


@dataclass(frozen=True)
class Node:
    """GPUS GPUs of USABLE_BYTES each (0 GPUs: a CPU machine), and the host's memory if known."""

    gpus: int
    usable_bytes: int  # per GPU (CPU: the host's memory for the roles)
    name: str  # "8 x H200", "cpu", ...
    visible_bytes: int = 0
    host_bytes: int | None = None

    @property
    def is_cpu(self) -> bool:
        return self.gpus == 0

    @property
    def gpu_memory_known(self) -> bool:
        return self.gpus > 0 and self.usable_bytes > 0
