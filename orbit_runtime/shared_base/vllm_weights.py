"""The rollout engine's side of the shared base: vLLM's own weight tensors moved into an arena.

Runs inside a vLLM worker (called by `rollout/vllm_worker_extension.py`). Every parameter
of the loaded model (INT4 linears in the layout vLLM's kernel uses after
`process_weights_after_loading`, embeddings, norms, biases, the LM head) is copied into
one sealed memory file, and the parameter becomes a read-only view of it: vLLM keeps
computing with the same values, now from the pages the learner maps too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from orbit_runtime.shared_base.arena import Arena, MappedArena, build_arena

KERNEL = "cpu_gemm_wna16"  # the INT4 linear kernel both sides call


class SharingRefused(RuntimeError):
    """The engine's weights are not in a form the learner can compute with."""


def shared_name(vllm_name: str) -> str:
    """A parameter's name without vLLM's LoRA wrapper (`qkv_proj.base_layer.weight` -> `qkv_proj.weight`)."""
    return vllm_name.replace(".base_layer.", ".")


@dataclass
class SharedWeights:
    """The engine's weights, moved into ARENA (kept open: the learner may ask again after a restart)."""

    arena: Arena
    mapped: MappedArena
    isa_hint: str
    dtype: str

    def meta(self) -> dict:
        return {"pid": os.getpid(), "inode": self.arena.inode, "kernel": KERNEL, "isa_hint": self.isa_hint,
                "dtype": self.dtype, "bytes": self.arena.size}  # fmt: skip


def _int4_kernel_settings(model: nn.Module) -> str:
    """The isa_hint every INT4 linear uses; refuses layers on the W4A8 path or mixed hints."""
    hints = set()
    for name, module in model.named_modules():
        if getattr(module, "use_w4a8", False):
            raise SharingRefused(
                f"{name} runs vLLM's W4A8 kernel (int8 activations, AMX); the colocated learner computes with the W4A16 "
                "kernel: start vLLM with VLLM_CPU_INT4_W4A8=0"
            )
        if hasattr(module, "isa_hint") and not hasattr(module, "base_layer"):
            hints.add(module.isa_hint)
    if len(hints) != 1:
        raise SharingRefused(f"expected one INT4 kernel variant across the model, found {sorted(hints) or 'none'}")
    return hints.pop()


def share_model_weights(model: nn.Module) -> SharedWeights:
    """Move every parameter of MODEL into one sealed arena (in place; see the module docstring)."""
    isa_hint = _int4_kernel_settings(model)
    params = list(model.named_parameters())  # each tensor once: a tied LM head is the embedding
    devices = {p.device.type for _, p in params}
    if devices != {"cpu"}:
        raise SharingRefused(f"the colocated base is shared through CPU memory; the engine's weights are on {sorted(devices)}")
    names = [shared_name(n) for n, _ in params]
    if len(set(names)) != len(names):
        raise SharingRefused("two of the engine's parameters have the same name without their LoRA wrapper")
    dtypes = {p.dtype for n, p in params if p.is_floating_point() and n.endswith(("weight_scale", "norm.weight"))}
    arena, mapped = build_arena(zip(names, (p for _, p in params), strict=True), move=True)
    _redispatch_dense_gemms(model)
    stray = [n for n, p in params if not mapped.holds(p.data)]
    if stray:
        raise SharingRefused(f"parameters still outside the shared base after moving it: {stray[:3]}")
    dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "mixed"
    return SharedWeights(arena, mapped, isa_hint, dtype)


def _redispatch_dense_gemms(model: nn.Module) -> None:
    """vLLM's CPU build gives each 16-bit linear (the LM head) a oneDNN/SGL handle made from its weight
    after loading; made again from the moved weight, the handle no longer keeps the old storage alive."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def stray_parameters(model: nn.Module, shared: SharedWeights) -> list[str]:
    """The engine's parameters whose memory is no longer the arena's (something replaced them)."""
    return [n for n, p in model.named_parameters() if not shared.mapped.holds(p.data)]


def linear_output(model: nn.Module, name: str, rows: int, seed: int) -> torch.Tensor:
    """vLLM's own output of INT4 linear NAME (shared name) for a seeded random input of ROWS rows:
    `scheme.apply_weights(layer, x, bias)`, the call its forward makes."""
    layers = {shared_name(n + "."): m for n, m in model.named_modules() if hasattr(m, "scheme") and hasattr(m, "weight_packed")}
    layer = layers.get(name + ".")
    if layer is None:
        raise KeyError(f"{name}: not an INT4 linear of the engine's model")
    from orbit_runtime.int4.vllm_cpu_kernel import enable_amx

    enable_amx()
    generator = torch.Generator().manual_seed(seed)
    in_features = layer.weight_packed.shape[1] // 2
    x = torch.randn(rows, in_features, generator=generator).to(layer.weight_scale.dtype)
    return layer.scheme.apply_weights(layer, x, getattr(layer, "bias", None))
