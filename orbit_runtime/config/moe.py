"""Settings for mixture-of-experts bases: how the learner routes tokens."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MoeSpec(BaseModel):
    """MoE training settings (ignored for dense bases, except that routing replay refuses them)."""

    model_config = ConfigDict(extra="forbid")

    routing_replay: bool = Field(
        False,
        description=(
            "Rollout Routing Replay (R3): the rollout returns the experts its routers chose for every token and "
            "layer, and the learner uses those experts, weighting them by its own router scores (gradients flow "
            "through the weights). Removes the train-rollout mismatch of near-tie routing flips. Needs an MoE base; "
            "on vLLM's CPU build it turns prefix caching off. Each step also scores the batch once without replay "
            "to report routing agreement and the mismatch replay removed."
        ),
    )
