"""Mixture-of-experts layers of the learner: a router and per-expert linears computed grouped.

transformers 5 keeps a model's routed experts as fused 3-D parameters, which PEFT cannot
wrap and which would have to be dense. The learner replaces each sparse MoE block with
`SparseMoeBlock`, whose experts are ordinary linear modules named as the checkpoint names
them (`mlp.experts.<e>.gate_proj`, ...). The loader then swaps them for packed
`Int4Linear`s like any other linear, so:

- an expert's dense weight exists only inside its own call (dequantized per call);
- the routed experts are computed grouped: tokens sorted by expert, one grouped GEMM per
  projection and layer over all experts, INT4 dequantized inside it (`grouped_experts.py`);
- with routing replay (`routing_replay.py`), the experts are the rollout's and their gate
  weights come from the learner's own router logits (R3);
- PEFT can put LoRA on the experts' linears and saves it per expert
  (`experts.<e>.gate_proj.lora_A.weight`), the layout vLLM's MoE LoRA loads.

Routing follows transformers' implementations exactly, and makes the same decisions with
the same weights as vLLM's native `grouped_topk` on the same logits (tested): Qwen3-MoE
scores with a softmax in fp32 over router logits in the model dtype, then top-k,
optionally renormalised; DeepSeek-V3 computes its router logits in fp32 (as transformers
does; vLLM keeps them in the model dtype unless `moe_router_dtype` is float32), scores with
a sigmoid, picks experts group-limited with the `e_score_correction_bias`, weights them by
their uncorrected scores, renormalises and scales by `routed_scaling_factor`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from orbit_runtime.errors import OrbitError
from orbit_runtime.learner.grouped_experts import grouped_expert_forward, looped_expert_forward
from orbit_runtime.moe_routing import MOE_BLOCK_CLASSES, RoutingSpec, choose_experts, gate_weights


class Router(nn.Module):
    """The gate: a frozen [E, H] projection (kept in 16 bit, never quantized) and the expert choice."""

    def __init__(self, hidden_size: int, spec: RoutingSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size), requires_grad=False)
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.scoring == "sigmoid":  # DeepSeek-V3 computes its router logits in fp32
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor, routing=None, layer_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate weights [N, k] float32, expert ids [N, k]): its own choice, or ROUTING's (replay) for
        layer LAYER_INDEX, weighted by its own scores either way."""
        logits = self.logits(x)
        ids = choose_experts(logits, self.spec, self.e_score_correction_bias)
        if routing is not None:
            ids = routing.experts(layer_index, ids)
        return gate_weights(logits, ids, self.spec), ids


class ExpertMLP(nn.Module):
    """One SwiGLU expert (also the shape of shared experts and dense MLP layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ DeepSeek's shared experts), with checkpoint-compatible names.

    `routing` (set by `Policy.routed`, else None) replays or compares the rollout's experts;
    `stacked` holds the experts' packed weights per projection once `stack_expert_weights` ran
    (then they are computed grouped, else one call per expert).
    """

    def __init__(self, hidden_size: int, expert_size: int, spec: RoutingSpec, shared_size: int = 0, layer_index: int = 0) -> None:
        super().__init__()
        self.gate = Router(hidden_size, spec)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, expert_size) for _ in range(spec.num_experts))
        self.shared_experts = ExpertMLP(hidden_size, shared_size) if shared_size else None
        self.layer_index = layer_index  # the decoder layer's index: the rollout's routing is per layer
        self.routing = None
        self.stacked: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}  # not buffers: views back them
        self.expert_compute = "grouped"  # or "loop" (the benchmark's baseline)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = self.gate(x, self.routing, self.layer_index)  # its own scores, also for replayed experts
        if self.stacked and self.expert_compute == "grouped":
            out = grouped_expert_forward(x, weights, ids, self)
        else:
            out = looped_expert_forward(x, weights, ids, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


def replace_moe_blocks(model: nn.Module, config) -> int:
    """Swap every transformers sparse MoE block of MODEL for a `SparseMoeBlock`; returns how many.

    Call it on the meta device, before any weight is loaded: the new blocks are empty.
    """
    block_class = MOE_BLOCK_CLASSES.get(config.model_type)
    if block_class is None:
        raise OrbitError(f"MoE model_type {config.model_type!r} is not supported; supported: {sorted(MOE_BLOCK_CLASSES)}")
    spec = RoutingSpec.from_config(config)
    shared = config.moe_intermediate_size * getattr(config, "n_shared_experts", 0)
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ == block_class:
            with torch.device(_device_of(module)):
                block = SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, spec, shared_size=shared,
                                       layer_index=_layer_index(name))  # fmt: skip
            block.to(_dtype_of(module))
            if block.gate.e_score_correction_bias is not None:  # a selection bias: fp32, as in transformers and vLLM
                block.gate.e_score_correction_bias = block.gate.e_score_correction_bias.float()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, block)
            replaced += 1
    if not replaced:
        raise OrbitError(f"{config.model_type}: no {block_class} found in the model")
    return replaced


def _layer_index(name: str) -> int:
    """'model.layers.3.mlp' -> 3."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next(p for p in module.parameters() if p.is_floating_point()).dtype


@contextlib.contextmanager
def per_expert_peft_layout(model: nn.Module) -> Iterator[None]:
    """Let PEFT see MODEL's MoE experts as the per-expert linears they are.

    With transformers 5, PEFT rewrites the LoRA targets (`gate_proj` -> the fused
    `gate_up_proj` parameter) and adapter keys of known MoE model types into transformers'
    fused 3-D expert layout. The learner's MoE blocks keep per-expert linears (the
    checkpoint's and vLLM's layout), so while PEFT injects or loads an adapter it is shown
    a model type that has no such conversion. Other models pass through untouched.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MOE_BLOCK_CLASSES:
        yield
        return
    config.model_type = f"orbit-per-expert-{model_type}"
    try:
        yield
    finally:
        config.model_type = model_type
