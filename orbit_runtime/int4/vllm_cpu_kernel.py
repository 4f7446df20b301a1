"""vLLM's CPU INT4 linear kernel (W4A16) and the inverse of its weight layout.

After `process_weights_after_loading`, vLLM's `CPUWNA16LinearKernel` holds each INT4 linear
[out, in] as
- `weight_packed` int32 [out / 16, in * 2]: blocks of 16 output columns, each block the
  [in, 16] codes packed 8 to an int32 along the outputs (value j in bits 4j..4j+3, +8);
- `weight_scale` [in / group_size, out] in the activation dtype;
and computes `y = x @ W.T + bias` with `cpu_gemm_wna16` (16-bit activations; vLLM's other
CPU path, W4A8 on AMX, quantizes the activations to int8 and is not used here).

`wna16_linear` calls that very op, so the colocated learner computes each INT4 linear with
the rollout's kernel on the rollout's bytes. `dequantize_transposed` is the inverse of the
layout in plain torch (it runs on any device): the learner's backward needs W, which the
kernel does not expose.

vLLM's CPU wheel builds `cpu_gemm_wna16` into its AVX-512 library only: on a CPU without
AVX-512 (AVX2: e.g. AMD Zen 2/3, older Intel) the op does not exist and every INT4 forward
fails. `portable_gemm_wna16` is the same GEMM in torch (dequantize to fp32, one matmul, the
result in the activations' dtype); `install_portable_kernel` puts it in vLLM's place when the
native op is missing, so INT4 bases serve there too, slower (the weight is dequantized at
every call).
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

from orbit_runtime.int4.packing import signed_codes

BLOCK_OUTPUTS = 16  # output columns per block of the repacked layout

if sys.byteorder != "little":  # the byte view below assumes little-endian int32
    raise ImportError("orbit_runtime.int4.vllm_cpu_kernel needs a little-endian machine")


@functools.cache
def enable_amx() -> bool:
    """Ask Linux for the AMX tile state (once per process); False where there is none.

    The kernel's `amx` variant runs AMX instructions, which a process may use only after
    `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; vLLM's workers ask for it, a
    learner process has to ask itself or die of SIGILL on its first INT4 linear.
    """
    if not sys.platform.startswith("linux") or not torch.cpu._is_amx_tile_supported():
        return False
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86_64 syscall numbers
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0


@functools.cache
def has_native_kernel() -> bool:
    """Whether vLLM's CPU library of this machine has `cpu_gemm_wna16` (its AVX-512 build has; AVX2 has not)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's _C library for this CPU's ISA)

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def portable_gemm_wna16(input: torch.Tensor, q_weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                        bias: torch.Tensor | None, pack_factor: int, isa_hint: str | None = None) -> torch.Tensor:  # fmt: skip
    """`cpu_gemm_wna16`'s contract in torch: y = input @ W.T + bias, W from vLLM's repacked layout
    (symmetric INT4, no zero points), computed in fp32 and returned in the input's dtype."""
    if zeros is not None or pack_factor != 8:
        raise NotImplementedError("the portable W4A16 kernel covers symmetric INT4 (no zero points, 8 codes per int32)")
    y = input.float() @ dequantize_transposed(q_weight, scales, torch.float32)
    if bias is not None:
        y += bias.float()
    return y.to(input.dtype)


def install_portable_kernel() -> bool:
    """Put portable_gemm_wna16 in vLLM's `_custom_ops.cpu_gemm_wna16` where the native op is missing
    (vLLM's CPU kernel calls it through that module); True when it did."""
    if has_native_kernel():
        return False
    from vllm import _custom_ops as ops

    ops.cpu_gemm_wna16 = portable_gemm_wna16
    return True


def wna16_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 isa_hint: str) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T + bias with vLLM's `cpu_gemm_wna16` (x: [..., in] in the scale's dtype)."""
    from vllm import _custom_ops as ops

    if isa_hint == "amx":
        enable_amx()
    rows = x.reshape(-1, x.shape[-1])
    gemm = ops.cpu_gemm_wna16 if has_native_kernel() else portable_gemm_wna16
    y = gemm(input=rows, q_weight=packed, scales=scale, zeros=None, bias=bias, pack_factor=8,
                           isa_hint=isa_hint)  # fmt: skip
    return y.view(*x.shape[:-1], y.shape[-1])


def _bytes_by_input(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The repacked int32 [out / 16, in * 2] -> uint8 [in, out / 2]: byte k of row i holds the codes of
    outputs 2k (low nibble) and 2k + 1 (high)."""
    if packed.dtype != torch.int32:
        raise TypeError(f"vLLM's repacked INT4 weights are int32, got {packed.dtype}")
    blocks = packed.shape[0]
    out_features = blocks * BLOCK_OUTPUTS
    by_input = packed.view(blocks, in_features, 2).permute(1, 0, 2).reshape(in_features, out_features // 8)
    return by_input.contiguous().view(torch.uint8)


def unpack_codes(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The repacked int32 [out / 16, in * 2] -> uint8 codes [in, out] (0..15, offset 8)."""
    as_bytes = _bytes_by_input(packed, in_features)
    return torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).view(in_features, -1)


def dequantize_transposed(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense W.T [in, out] in DTYPE from vLLM's repacked weight and its [groups, out] scales."""
    groups, out_features = scale.shape
    in_features = packed.shape[1] // 2
    codes = signed_codes(_bytes_by_input(packed, in_features), dtype)  # [in, out], offset removed in place
    return codes.view(groups, in_features // groups, out_features).mul_(scale.to(dtype).unsqueeze(1)).view(in_features, out_features)
