"""The LoRA adapter Orbit trains on top of the frozen INT4 base."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from orbit_runtime.errors import OrbitError

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


# LoRA targets vLLM never applies, per model type: DeepSeek-V3's MLA calls kv_b_proj in prefill
# through its attention implementation's own reference (taken before the LoRA wrapping) and uses
# the absorbed W_UK / W_UV in decode, so a LoRA on it never reaches the rollout.
UNSERVED_LORA_TARGETS = {"deepseek_v3": ("kv_b_proj",)}


def check_served_targets(model_type: str, adapter: AdapterSpec) -> None:
    """Refuse LoRA targets the rollout would silently leave out (the learner would train a
    policy vLLM does not sample from)."""
    unserved = [t for t in adapter.target_modules if t in UNSERVED_LORA_TARGETS.get(model_type, ())]
    if unserved:
        raise OrbitError(
            f"adapter.target_modules {unserved}: vLLM does not apply LoRA there on {model_type} models "
            "(its MLA attention computes kv_b_proj without the LoRA layer); adapt q_a_proj, q_b_proj, kv_a_proj_with_mqa "
            "and o_proj instead"
        )


def model_type(model_dir: Path) -> str:
    """MODEL_DIR's config.json `model_type`; "" when it cannot be read (the loader reports that, naming the file)."""
    try:
        return str(json.loads((model_dir / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""
