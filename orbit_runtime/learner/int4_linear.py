"""A frozen linear layer whose weight stays packed INT4; it is dequantized per call.

The dense weight of a layer exists only inside one forward or backward call of that layer
and is freed right after, so the learner never holds the whole base in 16 bit. Backward
recomputes the dense weight instead of saving it (activation memory stays as for a plain
linear). The base gets no gradient: packed weights and scales are buffers, not parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from orbit_runtime.int4.packing import dequantize_int4


class _Int4MatMul(torch.autograd.Function):
    """y = x @ dequant(W).T; grad flows to x only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:
        weight = dequantize_int4(packed, scale, in_features, x.dtype)
        ctx.save_for_backward(packed, scale)
        ctx.in_features = in_features
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        packed, scale = ctx.saved_tensors
        weight = dequantize_int4(packed, scale, ctx.in_features, grad_output.dtype)
        return grad_output @ weight, None, None, None


class Int4Linear(nn.Linear):
    """Drop-in for `nn.Linear` holding compressed-tensors `pack-quantized` INT4 weights.

    It subclasses `nn.Linear` so PEFT's LoRA wraps it like any linear. There is no dense
    weight: `weight` returns the packed int32 tensor (as GPTQ layers' `qweight` does), which
    tells PEFT the device and, being an integer dtype, leaves the adapter in its own
    trainable dtype. Code that needs real weight values calls `dequantized_weight()`.
    Buffer names match the checkpoint keys: `<module>.weight_packed`, `<module>.weight_scale`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        nn.Module.__init__(self)  # skip nn.Linear.__init__: it would allocate a dense weight
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} not divisible by group size {group_size}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.register_buffer(
            "weight_packed", torch.empty(out_features, (in_features + 7) // 8, dtype=torch.int32, device=device)
        )
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // group_size, dtype=dtype, device=device))
        if bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The packed weight (int32 [out, in/8]), not a dense matrix."""
        return self.weight_packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Int4MatMul.apply(x, self.weight_packed, self.weight_scale, self.in_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight of this one layer (for checks and tests)."""
        return dequantize_int4(self.weight_packed, self.weight_scale, self.in_features, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group_size={self.group_size}, bias={self.bias is not None}"
