"""What a plan is asked: the job's settings that decide memory, and the node.

`PlanRequest` is built from a job spec (`from_job_spec`: the same fields `orbit train` and
the pod run with) and then adjusted by `orbit plan`'s flags. The operator writes it into the
job's ConfigMap (`plan.json`), so `orbit prepare-base` plans the pod from exactly what the
operator saw, with the model's real `config.json`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orbit_runtime.config.adapter import DEFAULT_TARGETS
from orbit_runtime.config.spec import JobSpec
from orbit_runtime.plan.hardware import GIB, USABLE_SHARE, Node, gpu_model

Dtype = Literal["bf16", "fp16", "fp32"]
ROLES = ("rollout", "learner", "reference")


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeSpec(Frozen):
    """GPUS GPUs of a table model (`gpu`) or of `gpu_memory_bytes` total each; 0 GPUs: the CPU."""

    gpus: int = Field(8, ge=0, le=1024)
    gpu: str | None = Field(None, description="A GPU of the planner's table (H100, H200, B200, MI300X); with neither this "
                            "nor gpu_memory_bytes the GPUs' memory is unknown and only host memory is planned.")
    gpu_memory_bytes: int | None = Field(None, gt=0, description="One GPU's total memory, when it is not in the table.")
    host_memory_bytes: int | None = Field(None, gt=0)

    def node(self) -> Node:
        host = self.host_memory_bytes
        if self.gpus == 0:
            return Node(0, host or 0, "cpu", host or 0, host)
        if self.gpu_memory_bytes is not None:
            size = self.gpu_memory_bytes
            return Node(self.gpus, int(size * USABLE_SHARE), f"{self.gpus} x {size / GIB:.0f} GiB GPU", size, host)
        if self.gpu is None:
            return Node(self.gpus, 0, f"{self.gpus} GPUs of unknown memory", 0, host)
        model = gpu_model(self.gpu)
        return Node(self.gpus, model.usable_bytes, f"{self.gpus} x {model.name}", model.visible_bytes, host)


class RoleBudget(Frozen):
    """One container of the job's pod: its GPUs and its memory limit (bytes)."""

    gpus: int = Field(0, ge=0)
    memory_bytes: int | None = Field(None, gt=0)


class PlanRequest(Frozen):
    # quantization of the base (ignored when the model's config.json has its own compressed-tensors config)
    group_size: int = Field(128, ge=8)
    scale_dtype: Dtype = "bf16"
    ignore: tuple[str, ...] | None = Field(None, description="Modules kept 16-bit; None: orbit quantize's defaults.")
    # the adapter
    rank: int = Field(16, ge=1)
    targets: tuple[str, ...] = tuple(DEFAULT_TARGETS)
    routed_experts: bool = False
    # one step's batch
    prompts: int = Field(16, ge=1)
    group: int = Field(8, ge=1)
    prompt_tokens: int = Field(496, ge=1, description="The longest prompt planned for.")
    completion_tokens: int = Field(16, ge=1)
    # the learner
    micro_batch_tokens: int | None = Field(16384, ge=1)
    micro_batch_size: int | None = Field(None, ge=1)
    gradient_checkpointing: bool = True
    learner_dtype: Dtype = "bf16"
    learner_sharded: bool = Field(
        False, description="Plan the learner sharded over its GPUs (tensor/expert parallel, as DESIGN.md plans); "
        "today's learner computes on one device."
    )
    reference_mode: Literal["shared", "server"] = "shared"
    placement: Literal["separate", "colocated"] = Field(
        "separate", description="colocated: the learner maps the rollout's base, so its container holds no copy."
    )
    optimizer_steps: int = Field(1, ge=1, description="AdamW steps a batch (algorithm.minibatches x epochs_per_batch).")
    # the rollout
    dtype: Dtype = "bf16"
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vLLM's share of each of its GPUs (None: 0.9).")
    prefix_caching: bool | None = None
    max_model_len: int = Field(512, ge=1)
    cpu_kv_cache_gib: int = Field(1, ge=1, description="vLLM's CPU build allocates this much KV cache up front.")
    max_loras: int = Field(2, ge=1)
    node: NodeSpec = Field(default_factory=lambda: NodeSpec(gpu="H200"))
    roles: dict[Literal["rollout", "learner", "reference"], RoleBudget] | None = Field(
        None, description="The job's pod: GPUs and memory limit per container (None: suggest a split)."
    )

    @property
    def samples(self) -> int:
        return self.prompts * self.group

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def from_job_spec(spec: JobSpec, **changes) -> PlanRequest:
    """The plan request of a job (an `orbit train` config or an RLTrainingJob's runtime sections).

    The longest prompt is planned as rollout.max_model_len - rollout.max_tokens: the most a
    prompt can be and still leave room for a full completion.
    """
    rollout = spec.rollout
    fields = dict(
        rank=spec.adapter.rank, targets=tuple(spec.adapter.target_modules), routed_experts=spec.adapter.routed_experts,
        prompts=rollout.prompts_per_step, group=rollout.group_size,
        prompt_tokens=max(1, rollout.max_model_len - rollout.max_tokens), completion_tokens=rollout.max_tokens,
        micro_batch_tokens=spec.learner.micro_batch_tokens, micro_batch_size=spec.learner.micro_batch_size,
        gradient_checkpointing=spec.learner.gradient_checkpointing,
        learner_dtype=spec.model.learner_dtype or spec.model.dtype, dtype=spec.model.dtype, reference_mode=spec.reference.mode,
        placement=spec.placement,
        optimizer_steps=spec.algorithm.minibatches * spec.algorithm.epochs_per_batch,
        tensor_parallel_size=rollout.tensor_parallel_size, max_num_seqs=rollout.max_num_seqs,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        prefix_caching=rollout.enable_prefix_caching, max_model_len=rollout.max_model_len, cpu_kv_cache_gib=rollout.kv_cache_gib,
    )  # fmt: skip
    return PlanRequest(**{**fields, **changes})
