"""Rollout Routing Replay (R3): the learner uses the experts the rollout chose.

The rollout returns, per sample, the experts its router chose for every forwarded position
and layer: an int array [prompt + completion - 1, layers, k] (vLLM's `routed_experts`; the
last sampled token was never forwarded). `RoutedExperts` lays those arrays out as the
learner's padded batch and hands each MoE block its layer's rows:

- mode "replay": the block uses the rollout's experts; their gate weights are recomputed
  from the learner's own router logits (`gate_weights`), so gradients flow through the
  weights as in R3 while the choice can no longer flip on a near-tie;
- mode "compare": the block keeps its own choice and counts, per layer, the positions
  whose k experts equal the rollout's (the routing agreement metric).

Positions without rollout routing (the last position of each sequence, padding, a sample
whose routing did not come back) keep the learner's own choice. Pure tensor work: the
policy installs it around a forward (and the backward that recomputes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

NO_EXPERT = -1  # a position the rollout sent no routing for


@dataclass
class RoutingAgreement:
    """Positions whose chosen expert set equals the rollout's, per MoE layer (compare mode)."""

    agreeing: dict[int, int] = field(default_factory=dict)  # layer index -> positions
    compared: dict[int, int] = field(default_factory=dict)
    tokens_agreeing: int = 0  # positions whose experts equal the rollout's in every MoE layer
    tokens_compared: int = 0

    def add(self, other: RoutingAgreement) -> None:
        for layer, count in other.compared.items():
            self.compared[layer] = self.compared.get(layer, 0) + count
            self.agreeing[layer] = self.agreeing.get(layer, 0) + other.agreeing[layer]
        self.tokens_agreeing += other.tokens_agreeing
        self.tokens_compared += other.tokens_compared

    @property
    def overall(self) -> float | None:
        total = sum(self.compared.values())
        return sum(self.agreeing.values()) / total if total else None

    def per_layer(self) -> dict[int, float]:
        return {layer: self.agreeing[layer] / n for layer, n in sorted(self.compared.items()) if n}

    @property
    def token_agreement(self) -> float | None:
        """Share of positions routed like the rollout in ALL layers (published: ~6% in RL on large MoE)."""
        return self.tokens_agreeing / self.tokens_compared if self.tokens_compared else None


def routing_usable(routing: np.ndarray | None, prompt_len: int, completion_len: int, num_layers: int, top_k: int,
                   num_experts: int) -> bool:  # fmt: skip
    """Does ROUTING cover exactly the forwarded positions of this sample, for every layer, with real experts
    (a gap the rollout could not fill holds a value no expert has)?"""
    return (routing is not None and np.issubdtype(routing.dtype, np.integer)
            and routing.shape == (prompt_len + completion_len - 1, num_layers, top_k)
            and int(routing.min(initial=0)) >= 0 and int(routing.max(initial=0)) < num_experts)  # fmt: skip


class RoutedExperts:
    """The rollout's experts for one padded learner batch (see the module docstring)."""

    def __init__(
        self,
        pairs: Sequence[tuple[list[int], list[int]]],
        routing: Sequence[np.ndarray | None],
        num_layers: int,
        top_k: int,
        num_experts: int,
        mode: Literal["replay", "compare"] = "replay",
        device: torch.device | str = "cpu",
        keep_own: bool = False,
    ) -> None:
        if len(pairs) != len(routing):
            raise ValueError(f"{len(routing)} routing arrays for {len(pairs)} samples")
        width = max(len(p) + len(c) for p, c in pairs)
        plan = torch.full((len(pairs), width, num_layers, top_k), NO_EXPERT, dtype=torch.int32)
        self.missing = 0  # samples without usable routing (they keep the learner's own)
        for row, ((prompt, completion), experts) in enumerate(zip(pairs, routing, strict=True)):
            if not routing_usable(experts, len(prompt), len(completion), num_layers, top_k, num_experts):
                self.missing += 1
                continue
            plan[row, : experts.shape[0]] = torch.from_numpy(experts.astype(np.int32))
        self.plan = plan.view(len(pairs) * width, num_layers, top_k).to(device)
        self.width = width
        self.lengths = [len(p) + len(c) - 1 for p, c in pairs]
        self.own: dict[int, torch.Tensor] | None = {} if keep_own else None  # compare mode: the learner's choices
        self.mode = mode
        self.agreement = RoutingAgreement()
        self._given = self.plan[:, 0, 0] != NO_EXPERT
        self._token_agrees = self._given.clone()
        self._counted_layers: set[int] = set()

    def experts(self, layer: int, own: torch.Tensor) -> torch.Tensor:
        """The experts layer LAYER uses for its positions, given its own choice OWN [N, k]."""
        if own.shape[0] != self.plan.shape[0]:
            raise RuntimeError(f"routing for {self.plan.shape[0]} positions, the MoE layer got {own.shape[0]}")
        rollout = self.plan[:, layer].long()
        given = rollout[:, 0] != NO_EXPERT
        if self.mode == "compare":
            if layer in self._counted_layers:
                raise RuntimeError("compare mode counts one forward; build a new RoutedExperts for the next")
            self._counted_layers.add(layer)
            same = (own.sort(-1).values == rollout.sort(-1).values).all(-1) & given
            self._token_agrees &= same | ~given
            self.agreement.agreeing[layer] = int(same.sum())
            self.agreement.compared[layer] = int(given.sum())
            self.agreement.tokens_agreeing = int(self._token_agrees.sum())
            self.agreement.tokens_compared = int(self._given.sum())
            if self.own is not None:
                self.own[layer] = own.detach().to("cpu", torch.int16)
            return own
        return torch.where(given[:, None], rollout, own)

    def own_experts(self, sample: int, layer: int) -> torch.Tensor:
        """keep_own: the learner's own experts (sorted) at SAMPLE's forwarded positions in LAYER: [positions, k]."""
        if self.own is None:
            raise RuntimeError("own experts are kept only with keep_own=True in compare mode")
        start = sample * self.width
        return self.own[layer][start : start + self.lengths[sample]].long().sort(-1).values
