"""`make_plan`: a model and a job on a node -> parameters, the base's bytes, and the three layouts."""

from __future__ import annotations

from dataclasses import dataclass

from orbit_runtime.plan.activations import update_memory
from orbit_runtime.plan.architecture import Architecture
from orbit_runtime.plan.hardware import Node
from orbit_runtime.plan.layouts import LayoutPlan, full_finetune_layout, separate_layout, shared_layout
from orbit_runtime.plan.parameters import ParameterCount, count_parameters, model_linears
from orbit_runtime.plan.request import PlanRequest
from orbit_runtime.plan.weights import BaseWeights, Quantization, adapter_size, base_weights, lora_params, quantization_of

LAYOUTS = ("separate", "shared", "full_finetune")


@dataclass
class Plan:
    arch: Architecture
    request: PlanRequest
    node: Node
    params: ParameterCount
    quantization: Quantization
    base: BaseWeights
    lora_params: int
    adapter: dict  # adapter_size: parameters, learner, optimizer and sync bytes
    layouts: dict[str, LayoutPlan]
    nodes_bf16_state: int | None  # full fine-tuning with bf16 AdamW moments and no fp32 master copy

    @property
    def recommended(self) -> str | None:
        """separate where it fits (roles restart independently), else shared, else none."""
        for name in ("separate", "shared"):
            if self.layouts[name].fits:
                return name
        return None


def make_plan(arch: Architecture, request: PlanRequest) -> Plan:
    node = request.node.node()
    params = count_parameters(arch)
    quantization = quantization_of(arch, request)
    base = base_weights(arch, quantization)
    full = full_finetune_layout(arch, params.total, request, node)
    return Plan(
        arch=arch, request=request, node=node, params=params, quantization=quantization, base=base,
        lora_params=lora_params(model_linears(arch), request),
        adapter=adapter_size(model_linears(arch), request),
        layouts={"separate": separate_layout(arch, base, request, node), "shared": shared_layout(arch, base, request, node),
                 "full_finetune": full},
        nodes_bf16_state=full_finetune_layout(arch, params.total, request, node, state_bytes=8).nodes,
    )  # fmt: skip


@dataclass(frozen=True)
class StepPlan:
    """What one learner step adds on top of the loaded learner (one device), and its peak."""

    rows: dict[str, int]
    peak: int


def learner_step(arch: Architecture, request: PlanRequest, first: bool) -> StepPlan:
    """For comparisons with a measured step (`orbit plan --compare`, benchmarks/plan_accuracy.py).

    The step snapshot comes first, the gradients build up in backward while activations and logits
    live, AdamW updates after them. FIRST (a fresh run's first step): AdamW allocates its moments in
    its first update, after the logits are gone (with several optimizer steps a batch, the later
    minibatches' activations and logits then meet them), and the snapshot holds only the adapter's
    weights; later the moments exist before the step (not added by it) and the snapshot copies them too."""
    update = update_memory(arch, request)
    adapter = lora_params(model_linears(arch), request)
    rows = {"activations": update.activations, "logits": update.logits, "lora_gradients": 4 * adapter,
            "step_snapshot": (4 if first else 12) * adapter}  # fmt: skip
    held = rows["lora_gradients"] + rows["step_snapshot"]
    if first:
        rows["optimizer_state"] = 8 * adapter
        if request.optimizer_steps > 1:
            return StepPlan(rows, held + rows["optimizer_state"] + update.activations + update.logits)
        return StepPlan(rows, held + max(update.activations + update.logits, rows["optimizer_state"]))
    return StepPlan(rows, held + update.activations + update.logits)
