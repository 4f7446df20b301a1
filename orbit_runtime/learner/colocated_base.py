"""The learner's base in colocated placement: views of the rollout engine's tensors, its kernel.

vLLM holds the only copy of the base (`shared_base/`); this module builds the transformer
around read-only views of it. vLLM fuses q/k/v into `qkv_proj` and gate/up into
`gate_up_proj`; the learner keeps transformers' modules (and PEFT's LoRA on each), so each
of vLLM's INT4 linears becomes one `SharedInt4Projection` that computes the fused output
once per input with vLLM's own kernel (`int4/vllm_cpu_kernel.py`, the same call on the
same bytes as the rollout's forward), and transformers' q/k/v (gate/up) become
`SharedInt4Slice`s of it. The backward dequantizes the one layer's weight from vLLM's
layout (dX = dY @ W) and frees it: the base never becomes dense as a whole.

Embeddings, norms and the LM head are views too. Nothing here is a trainable parameter and
the pages are sealed against writes: an in-place write to the base faults instead of
changing it.
"""

from __future__ import annotations

import torch
from torch import nn

from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.vllm_cpu_kernel import dequantize_transposed, wna16_linear
from orbit_runtime.learner.int4_base import finish_frozen, meta_model, set_submodule, tie, tied_weight_keys
from orbit_runtime.learner.moe import MOE_BLOCK_CLASSES

# vLLM's fused INT4 linear -> (its parent in a decoder layer, transformers' linears it fuses, in order)
FUSED_LINEARS = {
    "self_attn.qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "self_attn.o_proj": ("self_attn", ("o_proj",)),
    "mlp.gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "mlp.down_proj": ("mlp", ("down_proj",)),
}
INT4_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".bias")


class _SharedInt4MatMul(torch.autograd.Function):
    """y = vLLM's kernel(x, W) + bias; dX = dY @ W with W dequantized from vLLM's layout."""

    @staticmethod
    def forward(ctx, x, packed, scale, bias, isa_hint):  # type: ignore[override]
        ctx.save_for_backward(packed, scale)
        return wna16_linear(x.contiguous(), packed, scale, bias, isa_hint)

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        packed, scale = ctx.saved_tensors
        weight_t = dequantize_transposed(packed, scale, grad_y.dtype)  # [in, out], this layer only
        return grad_y @ weight_t.t(), None, None, None, None


class SharedInt4Projection(nn.Module):
    """One of vLLM's INT4 linears, its tensors views of the shared base.

    CONSUMERS slices read its output; it is computed once per input tensor (q, k and v see
    the same hidden states) and dropped after the last slice has read it."""

    def __init__(self, key: str, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 isa_hint: str, consumers: int) -> None:  # fmt: skip
        super().__init__()
        self.key, self.isa_hint, self.consumers = key, isa_hint, consumers
        self.register_buffer("weight_packed", packed, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.in_features = packed.shape[1] // 2
        self.out_features = scale.shape[1]
        self._cached: tuple[torch.Tensor, bool, torch.Tensor] | None = None
        self._reads = 0

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The fused output for X, without the cache (for checks)."""
        return _SharedInt4MatMul.apply(x, self.weight_packed, self.weight_scale, self.bias, self.isa_hint)

    def reset(self) -> None:
        """Drop a cached output (and the graph and pages it holds)."""
        self._cached, self._reads = None, 0

    def output_for(self, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        if self._cached is None or self._cached[0] is not x or self._cached[1] != grad:
            y = self.compute(x)
            self._cached, self._reads = (x, grad, y), 0
        y = self._cached[2]
        self._reads += 1
        if self._reads >= self.consumers:
            self._cached = None
        return y

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] of this layer (for checks and tests)."""
        return dequantize_transposed(self.weight_packed, self.weight_scale, dtype).t()

    def extra_repr(self) -> str:
        return f"{self.key}: in={self.in_features}, out={self.out_features}, vLLM cpu_gemm_wna16 ({self.isa_hint})"


class SharedInt4Slice(nn.Linear):
    """transformers' q_proj (k_proj, gate_proj, ...): output columns START:END of a shared projection.

    A `nn.Linear` so PEFT wraps it with LoRA like any linear; `weight` is the packed int32
    tensor (an integer dtype: PEFT keeps the adapter in its own dtype), as for `Int4Linear`."""

    def __init__(self, projection: SharedInt4Projection, start: int, end: int) -> None:
        nn.Module.__init__(self)  # no dense weight
        object.__setattr__(self, "projection", projection)  # not a submodule: registered once, on the parent
        self.start, self.end = start, end
        self.in_features, self.out_features = projection.in_features, end - start
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.projection.weight_packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection.output_for(x)[..., self.start : self.end]

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.projection.dequantized_weight(dtype)[self.start : self.end]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.end} of {self.projection.key}"


def _shared_tensor(shared: dict[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    try:
        return shared[name]
    except KeyError:
        raise OrbitError(f"the rollout engine's model has no {name} ({where}): it does not serve this base") from None


def _bind_dense(model: nn.Module, shared: dict[str, torch.Tensor], used: set[str]) -> None:
    """Every remaining (meta) parameter of MODEL becomes the engine's tensor of the same name; a
    vocabulary vLLM padded is cut back to the model's rows (a view)."""
    for name, param in list(model.named_parameters()):
        if not param.is_meta:
            continue
        if name not in shared:
            continue  # tied, bound below
        view = shared[name]
        if view.shape != param.shape and view.shape[1:] == param.shape[1:] and view.shape[0] >= param.shape[0]:
            view = view[: param.shape[0]]
        if view.shape != param.shape or view.dtype != param.dtype:
            raise OrbitError(
                f"the rollout engine's {name} is {tuple(view.shape)} {view.dtype}, the learner's model needs "
                f"{tuple(param.shape)} {param.dtype} (model.dtype and model.learner_dtype must be equal when colocated)"
            )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, nn.Parameter(view, requires_grad=False))
        used.add(name)


def build_colocated_base(model_dir, dtype: torch.dtype, shared: dict[str, torch.Tensor], isa_hint: str) -> nn.Module:
    """The frozen base over SHARED (the engine's tensors by name, from `attach_shared_base`)."""
    model, config, _ = meta_model(model_dir, dtype)
    if config.model_type in MOE_BLOCK_CLASSES:
        raise OrbitError(
            f"placement: colocated runs dense models in this version; {model_dir} is {config.model_type} (MoE): "
            "use placement: separate"
        )
    used: set[str] = set()
    for index, layer in enumerate(model.model.layers):
        for fused, (parent_name, children) in FUSED_LINEARS.items():
            key = f"model.layers.{index}.{fused}"
            packed = _shared_tensor(shared, key + ".weight_packed", "an INT4 linear")
            scale = _shared_tensor(shared, key + ".weight_scale", "an INT4 linear")
            bias = shared.get(key + ".bias")
            used |= {key + s for s in INT4_SUFFIXES if key + s in shared}
            parent = layer.get_submodule(parent_name)
            linears = [parent.get_submodule(child) for child in children]
            projection = SharedInt4Projection(key, packed, scale, bias, isa_hint, consumers=len(children))
            widths = [linear.out_features for linear in linears]
            if sum(widths) != projection.out_features or any(lin.in_features != projection.in_features for lin in linears):
                raise OrbitError(
                    f"the rollout engine's {key} is {projection.in_features} -> {projection.out_features}; the model's "
                    f"{'/'.join(children)} need {linears[0].in_features} -> {widths}"
                )
            parent.register_module(fused.rsplit(".", 1)[1] + "_int4", projection)
            start = 0
            for child, width in zip(children, widths, strict=True):
                set_submodule(parent, child, SharedInt4Slice(projection, start, start + width))
                start += width
    _bind_dense(model, shared, used)
    for target, source in tied_weight_keys(model, config).items():
        if model.get_parameter(target).is_meta and not model.get_parameter(source).is_meta:
            tie(model, target, source)
    unused = sorted(set(shared) - used)
    if unused:
        raise OrbitError(f"the rollout engine's model has tensors the learner's {config.model_type} does not: {unused[:5]}")
    finish_frozen(model, config, lambda names: OrbitError(f"the rollout engine's model lacks tensors the learner needs: {names}"))
    return model


def rebind_colocated_base(model: nn.Module, shared: dict[str, torch.Tensor]) -> int:
    """Point MODEL's base at a new arena (the engine restarted and shared its base again): every
    view is swapped for the new one of the same name and shape. Returns the tensors rebound."""
    count = 0
    for module in model.modules():
        if isinstance(module, SharedInt4Projection):
            module.reset()
            for attr in ("weight_packed", "weight_scale", "bias"):
                old = getattr(module, attr)
                if old is None:
                    continue
                new = _shared_tensor(shared, f"{module.key}.{attr}", "after the rollout restarted")
                if new.shape != old.shape or new.dtype != old.dtype:
                    raise OrbitError(f"the restarted rollout engine's {module.key}.{attr} has another shape: another base")
                setattr(module, attr, new)
                count += 1
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        key = name.removeprefix("base_model.model.")
        if key in shared:
            new = shared[key][: param.shape[0]] if shared[key].dim() else shared[key]
            if new.shape != param.shape:
                raise OrbitError(f"the restarted rollout engine's {key} has another shape: another base")
            param.data = new
            count += 1
    return count
