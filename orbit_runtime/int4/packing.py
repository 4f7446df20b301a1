"""Pure tensor functions for the compressed-tensors `pack-quantized` INT4 layout.

Layout (as written by compressed-tensors' `pack_to_int32`): a weight of shape [out, in] is
stored as `weight_packed` int32 [out, in / 8]; int32 column j holds the eight signed int4
values of columns 8j..8j+7, value i in bits 4i..4i+3, each offset by +8 (unsigned 0..15).
`weight_scale` [out, in / group_size] holds one symmetric scale per group of columns.

These run on any device (CPU or CUDA) and are what the learner uses on every forward.
"""

from __future__ import annotations

import sys

import torch

PACK_FACTOR = 8  # int4 values per int32

if sys.byteorder != "little":  # the byte view below assumes little-endian int32 (x86, ARM, CUDA)
    raise ImportError("orbit_runtime.int4.packing needs a little-endian machine")


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [out, ceil(in/8)] -> int8 [out, in] with values in [-8, 7].

    Works on the bytes: in a little-endian int32, byte k holds values 2k (low nibble) and
    2k+1 (high nibble) (`signed_codes`).
    """
    _check_packed(packed)
    return signed_codes(packed.view(torch.uint8), torch.int8)[:, :in_features].contiguous()


def _check_packed(packed: torch.Tensor) -> None:
    if packed.dtype != torch.int32:
        raise TypeError(f"packed INT4 weights must be int32, got {packed.dtype}")


def signed_codes(as_bytes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., n], two INT4 codes a byte (low nibble first, each offset by +8) -> their values
    in [-8, 7] as DTYPE [..., 2n].

    The nibbles are written straight into the one DTYPE tensor and shifted in place: no int8,
    stacked or cast temporaries (only the two half-size uint8 nibble tensors). This runs on
    every forward and backward of every INT4 layer, and each big temporary is a fresh
    allocation the next layer page-faults in again (benchmarks/int4_dequant.py measures it
    against the stack-and-cast version).
    """
    values = torch.empty(*as_bytes.shape, 2, dtype=dtype, device=as_bytes.device)
    values[..., 0] = as_bytes & 0xF
    values[..., 1] = as_bytes >> 4
    return values.view(*as_bytes.shape[:-1], -1).sub_(8)


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """Dense [out, in] weight in `dtype` from packed int4 values and per-group scales."""
    _check_packed(packed)
    out_features, num_groups = scale.shape
    group_size = in_features // num_groups
    q = signed_codes(packed.view(torch.uint8), dtype)[:, :in_features].contiguous()  # a copy only if in % 8 != 0
    return q.view(out_features, num_groups, group_size).mul_(scale.to(dtype).unsqueeze(-1)).view(out_features, in_features)


def packed_nbytes(out_features: int, in_features: int, group_size: int, scale_dtype: torch.dtype) -> int:
    """Bytes a packed INT4 linear needs: 4 bits a weight plus one scale per group."""
    packed = out_features * ((in_features + PACK_FACTOR - 1) // PACK_FACTOR) * 4
    scales = out_features * (in_features // group_size) * torch.empty((), dtype=scale_dtype).element_size()
    return packed + scales
