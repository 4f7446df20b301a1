"""The three ways to lay a job out on a node, each with a verdict and the row that binds.

- separate: today's pod. vLLM on its GPUs (tensor parallel), the learner on its own, a
  reference server on a third if `reference.mode: server`; each holds a copy of the base.
- shared: one copy of the base, on all GPUs (vLLM's shards); the learner computes on the same
  tensors, and the rollout (KV cache, vLLM scratch) and the update (activations, logits)
  take turns with the memory between them (`placement: colocated`; built for CPU, its GPU path is not).
- full_finetune: the traditional scheme B, full-parameter bf16 training with AdamW, sharded
  over as many nodes as it needs.

A layout fits when every GPU's rows fit its usable memory; its binding row is the largest row
of its fullest GPU (relative to what that GPU can hold).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orbit_runtime.plan.activations import update_memory
from orbit_runtime.plan.architecture import Architecture
from orbit_runtime.plan.hardware import Node
from orbit_runtime.plan.request import PlanRequest
from orbit_runtime.plan.roles import (
    GPU_RUNTIME,
    full_finetune_rows,
    host_bytes,
    learner_rows,
    reference_rows,
    rollout_rows,
)
from orbit_runtime.plan.weights import BaseWeights

MAX_NODES = 256
VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of each GPU


def rollout_usable(node: Node, request: PlanRequest) -> int:
    """What vLLM may use of one of its own GPUs: rollout.gpu_memory_utilization (vLLM's 0.9 by default) of
    the GPU's memory, never more than the planner's usable share."""
    share = request.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
    return min(node.usable_bytes, int(share * node.visible_bytes)) if node.visible_bytes else node.usable_bytes


@dataclass
class GpuGroup:
    """GPUS identical GPUs (0: the host) running ROLES, each holding ROWS; rows in PHASES take turns."""

    roles: tuple[str, ...]
    gpus: int
    rows: dict[str, int]
    usable: int
    phases: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def counted(self) -> dict[str, int]:
        """The rows at the group's peak: all rows outside phases, plus the largest phase's."""
        in_phase = {row for rows in self.phases.values() for row in rows}
        out = {k: v for k, v in self.rows.items() if k not in in_phase}
        if self.phases:
            peak = max(self.phases.values(), key=lambda rows: sum(self.rows.get(r, 0) for r in rows))
            out.update({r: self.rows[r] for r in peak if r in self.rows})
        return out

    @property
    def total(self) -> int:
        return sum(self.counted().values())

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def binding(self) -> str:
        counted = self.counted()
        return max(counted, key=counted.get)

    @property
    def load(self) -> float:
        return self.total / self.usable if self.usable else float("inf")


@dataclass
class LayoutPlan:
    name: str
    groups: list[GpuGroup]
    split: dict[str, int]
    notes: list[str] = field(default_factory=list)
    host: dict[str, int] = field(default_factory=dict)  # host memory each role needs to load (GPU roles)
    nodes: int | None = 1  # full_finetune: nodes it needs (None: more than MAX_NODES)
    applicable: bool = True

    @property
    def fits(self) -> bool:
        return self.applicable and all(group.fits for group in self.groups)

    @property
    def tightest(self) -> GpuGroup:
        return max(self.groups, key=lambda g: g.load)

    @property
    def binding(self) -> str:
        return self.tightest.binding if self.applicable else "not_applicable"


def valid_shards(arch: Architecture, base: BaseWeights, n: int) -> bool:
    """Can vLLM split this model n ways? Heads (and KV heads, or n a multiple of them) divide; every
    tensor-parallel linear's split dimension divides, and for an INT4 row-parallel linear (o_proj,
    down_proj, w2: its input is split) each rank's slice holds whole scale groups, as vLLM's INT4
    kernels require (Qwen3-235B's 1,536-wide experts do not split 8 ways at group 128)."""
    a = arch.attention
    if a.heads % n or (a.kind == "gqa" and a.kv_heads % n and n % a.kv_heads):
        return False
    for suffix, in_features, out_features, int4 in base.split_shapes:
        if suffix in ("o_proj", "down_proj", "w2"):
            if in_features % n or (int4 and (in_features // n) % base.group_size):
                return False
        elif out_features % n and suffix not in ("k_proj", "v_proj"):
            return False
    return True


def _sum_rows(*row_sets: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rows in row_sets:
        for key, value in rows.items():
            out[key] = out.get(key, 0) + value
    return out


def separate_layout(arch: Architecture, base: BaseWeights, request: PlanRequest, node: Node) -> LayoutPlan:
    """Each role its own copy of the base, on the best split of the node's GPUs (a job's own split is
    job_fit's)."""
    server = request.reference_mode == "server"
    notes = []
    if node.is_cpu:
        rows = [rollout_rows(arch, base, request, 1, cpu=True), learner_rows(arch, base, request, cpu=True)]
        if server:
            rows.append(reference_rows(arch, base, request, cpu=True))
        roles = ("rollout", "learner", *(("reference",) if server else ()))
        return LayoutPlan("separate", [GpuGroup(roles, 0, _sum_rows(*rows), node.usable_bytes)], {r: 0 for r in roles})
    if node.gpus == 1:
        rows = [rollout_rows(arch, base, request, 1), learner_rows(arch, base, request)]
        if server:
            rows.append(reference_rows(arch, base, request))
        notes.append("one GPU: vLLM, the learner (and the reference server) share it, each with its own copy of the base")
        return LayoutPlan("separate", [GpuGroup(("rollout", "learner", *(("reference",) if server else ())), 1, _sum_rows(*rows),
                                                node.usable_bytes)], {"rollout": 1, "learner": 1, "reference": int(server)},
                          notes, host=_host(base, request, server))  # fmt: skip
    plans = [_separate(arch, base, request, node, split) for split in _splits(arch, base, request, node.gpus, server)]
    if not plans:
        return LayoutPlan("separate", [], {}, [f"{node.gpus} GPUs cannot be split into rollout, learner"
                                               + (" and reference" if server else "")], applicable=False)  # fmt: skip
    best = min(plans, key=lambda p: (not p.fits, p.tightest.load, -sum(p.split.values())))
    idle = node.gpus - sum(best.split.values())
    if idle and best.fits:
        best.notes.append(f"{idle} GPU(s) idle: no larger split of this model's heads and widths helps")
    if not request.learner_sharded:
        best.notes.append("the learner on one device, as today's learner computes (--sharded-learner plans it sharded)")
    return best


def _splits(arch: Architecture, base: BaseWeights, request: PlanRequest, gpus: int, server: bool) -> list[dict[str, int]]:
    """Every (rollout, learner, reference) split vLLM and the learner can use; GPUs left over stay idle.
    A one-device learner (today's) takes one GPU."""
    reference = 1 if server else 0
    out = []
    for rollout in range(1, gpus - reference):
        if not valid_shards(arch, base, rollout):
            continue
        left = gpus - rollout - reference
        learners = [n for n in range(1, left + 1) if valid_shards(arch, base, n)] if request.learner_sharded else [1]
        out += [{"rollout": rollout, "learner": n, "reference": reference} for n in learners]
    return out


def _host(base: BaseWeights, request: PlanRequest, server: bool) -> dict[str, int]:
    roles = ("rollout", "learner", *(("reference",) if server else ()))
    return {role: host_bytes(role, base, request) for role in roles}


def _separate(arch: Architecture, base: BaseWeights, request: PlanRequest, node: Node, split: dict[str, int]) -> LayoutPlan:
    tp = split["rollout"]
    request = request.model_copy(update={"tensor_parallel_size": tp})
    groups = [GpuGroup(("rollout",), tp, rollout_rows(arch, base, request, tp), rollout_usable(node, request))]
    learner_shards = split["learner"] if request.learner_sharded else 1
    if split["learner"]:
        groups.append(GpuGroup(("learner",), split["learner"], learner_rows(arch, base, request, learner_shards), node.usable_bytes))
    server = request.reference_mode == "server"
    if server and split.get("reference"):
        groups.append(GpuGroup(("reference",), split["reference"], reference_rows(arch, base, request), node.usable_bytes))
    host = _host(base, request, server)
    if node.host_bytes:  # the machine's memory is known: the roles' loading must fit it together
        groups.append(GpuGroup(("host",), 0, {"host_memory": sum(host.values())}, node.host_bytes))
    return LayoutPlan("separate", groups, dict(split), host=host)


def shared_layout(arch: Architecture, base: BaseWeights, request: PlanRequest, node: Node) -> LayoutPlan:
    """One copy of the base on all GPUs; the learner sharded like vLLM, computing in vLLM's dtype."""
    if node.is_cpu:  # placement colocated as built: the learner maps vLLM's base in host memory
        computed = request.model_copy(update={"learner_dtype": request.dtype})
        learner = {**learner_rows(arch, base, computed, cpu=True), "base_int4": 0, "base_16bit": 0}
        rows = _sum_rows(rollout_rows(arch, base, computed, 1, cpu=True), learner)
        notes = ["vLLM and the learner in host memory with one copy of the base (placement: colocated)"]
        if request.learner_dtype != request.dtype:
            notes.append(f"the learner computes in vLLM's dtype ({request.dtype}) on vLLM's tensors, not in {request.learner_dtype}")
        return LayoutPlan("shared", [GpuGroup(("rollout", "learner"), 0, rows, node.usable_bytes)], {"shared": 0}, notes)
    n = max(k for k in range(1, node.gpus + 1) if valid_shards(arch, base, k))
    computed = request.model_copy(update={"learner_dtype": request.dtype, "tensor_parallel_size": n})
    rollout = rollout_rows(arch, base, computed, n)
    learner = learner_rows(arch, base, computed, n)
    rows = {
        "base_int4": rollout["base_int4"], "base_16bit": rollout["base_16bit"],
        "lora": rollout["lora"] + learner["lora"],
        "kv_cache": rollout["kv_cache"], "rollout_activations": rollout["rollout_activations"],
        "activations": learner["activations"], "logits": learner["logits"], "runtime": GPU_RUNTIME["shared"],
    }  # fmt: skip
    phases = {"rollout": ("kv_cache", "rollout_activations"), "update": ("activations", "logits")}
    notes = [f"vLLM and the learner on all {n} GPUs, one copy of the base; rollout and update take turns with the memory"]
    if n < node.gpus:
        notes.append(f"the model splits at most {n} ways on {node.gpus} GPUs: {node.gpus - n} stay idle")
    if request.learner_dtype != request.dtype:
        notes.append(f"the learner computes in vLLM's dtype ({request.dtype}) on vLLM's tensors, not in {request.learner_dtype}")
    if request.reference_mode == "server":
        notes.append("the reference is the shared base with the adapter disabled: no server copy")
    return LayoutPlan("shared", [GpuGroup(("rollout", "learner"), n, rows, node.usable_bytes, phases)], {"shared": n}, notes)


def full_finetune_layout(arch: Architecture, total_params: int, request: PlanRequest, node: Node, state_bytes: int = 16) -> LayoutPlan:
    """Scheme B on this node, and the nodes of this kind it needs."""
    per_node = max(node.gpus, 1)
    request = request.model_copy(update={"micro_batch_tokens": None, "micro_batch_size": 1})  # the baseline's smallest micro-batch
    phases = {"rollout": ("rollout_weights", "kv_cache"), "update": ("gradients", "activations", "logits")}

    update = update_memory(arch, request.model_copy(update={"learner_dtype": "bf16"}), 1, full_finetune=True)

    def group(nodes: int) -> GpuGroup:
        rows = full_finetune_rows(arch, total_params, request, nodes, per_node, state_bytes, update)
        return GpuGroup(("trainer", "rollout"), per_node, rows, node.usable_bytes, phases)

    here = group(1)
    needed = next((n for n in range(1, MAX_NODES + 1) if group(n).fits), None)
    notes = ["FSDP/ZeRO-3 over all GPUs of all nodes, one sequence a micro-batch; vLLM's bf16 copy and KV cache take turns "
             "with gradients and activations (vLLM sleep mode): the baseline's smallest setting"]  # fmt: skip
    plan = LayoutPlan("full_finetune", [here], {"gpus_per_node": per_node}, notes, nodes=needed)
    if node.is_cpu:
        plan.applicable = False
    return plan
