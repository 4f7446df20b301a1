"""Where and how the learner computes: device, gradient checkpointing, micro-batches.

None of these settings changes what a step computes (micro-batched gradients equal one big
batch's up to float rounding), so they are left out of the resume fingerprint: a run can be
resumed on a GPU, or with a smaller token budget after running out of memory.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LearnerSpec(BaseModel):
    """The learner's placement and memory settings (the rollout's are in RolloutSpec)."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="auto: the first CUDA device if torch sees one, else the CPU. cuda fails at start when there is "
        "no GPU. The shared reference (reference.mode: shared) runs where the learner runs.",
    )
    gradient_checkpointing: bool = Field(
        True,
        description="Recompute each decoder layer's activations in backward instead of keeping them (as verl and TRL "
        "do by default): activation memory, not the INT4 base, dominates at RL lengths. Costs about one extra forward.",
    )
    micro_batch_tokens: int | None = Field(
        16384,
        ge=1,
        description="Most padded tokens (sequences x longest prompt+completion) one forward/backward holds. Samples "
        "are length-bucketed into micro-batches under this budget and their gradients accumulated; loss normalisers "
        "are global, so the update equals one big batch's. A longer single sequence gets a micro-batch of its own. "
        "null: no token limit.",
    )
    lora_rounding: Literal["vllm", "fp32"] = Field(
        "vllm",
        description="vllm: the adapter's forward rounds where vLLM's LoRA kernels round (adapter cast to the model dtype, "
        "scaling folded into B, shrink in fp32, expand and add in the model dtype), so the learner computes what the "
        "rollout served; gradients still reach fp32 master weights. fp32: PEFT's forward (one fp32 delta). No effect in "
        "an fp32 learner. benchmarks/mismatch.py measures both.",
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="Most sequences per micro-batch (null: no limit besides micro_batch_tokens)."
    )
    pin_malloc_threshold: bool = Field(
        True,
        description="Pin glibc's mmap threshold at 4 MiB in the learner process, so the step's freed big temporaries go "
        "back to the OS instead of staying in the heap (glibc raises the threshold after large frees). "
        "benchmarks/memory.py measures the peak and the step time both ways (bf16 learner: 1.26x the peak unpinned, "
        "1.03x the time pinned); with an fp32 learner on 2 AVX2 cores the pin costs more time (vs_trl.py's no_malloc_pin "
        "lever: the tiny train phase 1.6 s unpinned vs 3.1 s pinned, one side-by-side run). No effect off glibc.",
    )


# Positions whose logits the learner's log-softmax holds at once (learner/token_logprobs.py;
# the planner's logits row). 1024 x a 160k vocabulary x 12 bytes is ~2 GB.
LOGPROB_CHUNK_TOKENS = 1024
