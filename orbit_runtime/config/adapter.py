"""The LoRA adapter Orbit trains on top of the frozen INT4 base."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class AdapterSpec(BaseModel):
    """LoRA hyper-parameters; the same values configure PEFT (learner) and vLLM (max rank)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, ge=1, le=512, description="LoRA rank r.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input (0 keeps train and rollout identical).")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        min_length=1,
        description="Names of the linear modules that get an adapter (matched as PEFT does, by suffix).",
    )
    routed_experts: bool = Field(
        False,
        description=(
            "MoE models: also put LoRA on every routed expert's linears matching target_modules (saved per expert, "
            "the layout vLLM's MoE LoRA loads). Off: only attention, shared experts and dense MLP layers are adapted."
        ),
    )
