"""Routed experts computed grouped: one grouped GEMM per projection and layer, no loop over experts.

Tokens are sorted by expert and each of the layer's three projections (gate, up, down) is one
`torch._grouped_mm` over all experts at once: expert e multiplies the rows
offs[e-1]:offs[e] of the sorted activations. The INT4 weights are dequantized inside the
grouped op (`_GroupedInt4MatMul`), all of a layer's experts of one projection together, and
freed when it returns; backward dequantizes them again instead of saving them, as
`Int4Linear` does for one linear. The expert ids and offsets stay on the device (on CPU
the forward makes no host sync).

For that the experts' packed weights are stacked: `stack_expert_weights` gives each MoE
block one [E, out, in/8] tensor per projection, and every expert's `Int4Linear` buffers
become views of it (no second copy). LoRA on the routed experts (PEFT wraps each expert's
linear) is computed grouped too, from the experts' A and B stacked per call (small), with
PEFT's rounding or vLLM's (`lora_numerics.py`), so the result equals the per-expert loop
(`looped_expert_forward`, kept as the reference and the benchmark's baseline). On CUDA,
`bincount` reads one value back to the host, and `_grouped_mm` takes bf16 only (16-byte
aligned): fp32 and odd LoRA ranks fall back to one matmul per expert there (`grouped_mm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from orbit_runtime.int4.packing import dequantize_int4
from orbit_runtime.learner.int4_linear import Int4Linear
from orbit_runtime.learner.lora_numerics import VllmRoundedLoraLinear

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def dequantize_stacked(packed: torch.Tensor, scale: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, out, in/8] int32 + [E, out, groups] scales -> dense [E, out, in] in DTYPE."""
    experts, out_features, _ = packed.shape
    flat = dequantize_int4(packed.reshape(experts * out_features, -1), scale.reshape(experts * out_features, -1),
                           in_features, dtype)  # fmt: skip
    return flat.view(experts, out_features, in_features)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x[rows of e] @ weight[e] for each expert e (rows offs[e-1]:offs[e]): torch._grouped_mm, or where it
    refuses the inputs (CUDA takes bf16 only, on sm90+) one matmul per expert after a host sync."""
    try:
        return torch._grouped_mm(x, weight, offs=offs)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError):
        if not x.is_cuda:
            raise
        bounds = [0, *offs.tolist()]
        return torch.cat([x[a:b] @ weight[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))])


class _GroupedInt4MatMul(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ dequant(W_e).T for every expert e; grad flows to x only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, in_features: int):
        weight = dequantize_stacked(packed, scale, in_features, x.dtype)
        ctx.save_for_backward(offs, packed, scale)
        ctx.in_features = in_features
        return grouped_mm(x, weight.transpose(1, 2), offs)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        offs, packed, scale = ctx.saved_tensors
        weight = dequantize_stacked(packed, scale, ctx.in_features, grad_output.dtype)
        return grouped_mm(grad_output.contiguous(), weight, offs), None, None, None, None


def _base(layer: nn.Module) -> nn.Module:
    return layer.base_layer if isinstance(layer, LoraLayer) else layer


def stack_expert_weights(model: nn.Module) -> int:
    """Give every MoE block of MODEL stacked expert weights (module docstring); returns how many blocks.

    Call it once the base sits on its final device: moving the model afterwards would copy the
    stack and the per-expert views separately.
    """
    from orbit_runtime.learner.moe import SparseMoeBlock

    stacked = 0
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        linears = {name: [_base(getattr(e, name)) for e in block.experts] for name in PROJECTIONS}
        if not all(isinstance(lin, Int4Linear) and lin.bias is None for group in linears.values() for lin in group):
            continue  # dense experts (a reference model) or biased ones: the per-expert loop computes them
        for name, group in linears.items():
            packed = torch.stack([lin.weight_packed for lin in group])
            scale = torch.stack([lin.weight_scale for lin in group])
            for index, lin in enumerate(group):
                lin._buffers["weight_packed"] = packed[index]
                lin._buffers["weight_scale"] = scale[index]
            block.stacked[name] = (packed, scale, group[0].in_features)
        stacked += 1
    return stacked


def _lora_delta(x: torch.Tensor, offs: torch.Tensor, layers: list[nn.Module], result_dtype: torch.dtype) -> torch.Tensor | None:
    """The experts' LoRA contribution to the grouped projection, as PEFT (or vLLM's rounding) adds it;
    None when the experts carry no active adapter."""
    first = layers[0]
    if not isinstance(first, LoraLayer) or first.disable_adapters or first.merged:
        return None
    total = None
    for adapter in first.active_adapters:
        if adapter not in first.lora_A:
            continue
        a = torch.stack([layer.lora_A[adapter].weight for layer in layers])  # [E, r, in]
        b = torch.stack([layer.lora_B[adapter].weight for layer in layers])  # [E, out, r]
        scaling = first.scaling[adapter]
        dropped = first.lora_dropout[adapter](x)  # one dropout over the group (p = 0 in Orbit's defaults)
        if isinstance(first, VllmRoundedLoraLinear) and x.dtype != torch.float32:
            a_served, b_served = a.to(result_dtype), b.to(result_dtype) * scaling
            shrunk = grouped_mm(dropped.float(), a_served.float().transpose(1, 2), offs)
            delta = grouped_mm(shrunk.to(result_dtype), b_served.transpose(1, 2), offs)
        else:  # PEFT: the input cast to the adapter's dtype, the delta added in it
            shrunk = grouped_mm(dropped.to(a.dtype), a.transpose(1, 2), offs)
            delta = grouped_mm(shrunk, b.transpose(1, 2), offs) * scaling
        total = delta if total is None else total + delta
    return total


def _projection(x: torch.Tensor, offs: torch.Tensor, block, name: str) -> torch.Tensor:
    packed, scale, in_features = block.stacked[name]
    y = _GroupedInt4MatMul.apply(x, offs, packed, scale, in_features)
    delta = _lora_delta(x, offs, [getattr(e, name) for e in block.experts], y.dtype)
    return y if delta is None else (y + delta).to(y.dtype)


def grouped_expert_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, block) -> torch.Tensor:
    """sum_k weights[n, k] * expert_{ids[n, k]}(x[n]) for BLOCK's routed experts, grouped (module docstring).

    Slots are sorted by expert id (stable) and added back in that order, as the loop adds them.
    """
    top_k = ids.shape[-1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    offs = torch.cumsum(torch.bincount(flat_ids, minlength=len(block.experts)), 0).to(torch.int32)
    rows = x[tokens]
    hidden = F.silu(_projection(rows, offs, block, "gate_proj")) * _projection(rows, offs, block, "up_proj")
    out_rows = _projection(hidden, offs, block, "down_proj") * weights.reshape(-1)[order].to(x.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, tokens, out_rows)


def looped_expert_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """The same sum, one call per expert that received tokens (one host sync for the counts).

    The reference the grouped compute is tested against, and the path for dense experts.
    """
    top_k = ids.shape[-1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    slot_weights = weights.reshape(-1)[order].to(x.dtype)
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert_id, count in enumerate(counts):
        if count == 0:
            continue
        group = slice(start, start + count)
        token_ids = tokens[group]
        out.index_add_(0, token_ids, experts[expert_id](x[token_ids]) * slot_weights[group, None])
        start += count
    return out
