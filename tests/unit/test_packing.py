"""INT4 packing: Orbit's fast unpack must agree with compressed-tensors' reference code."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from orbit_runtime.int4.packing import dequantize_int4, packed_nbytes, unpack_int4
from orbit_runtime.int4.schemes import W4A16Int


def test_unpack_matches_compressed_tensors():
    values = torch.randint(-8, 8, (48, 256), dtype=torch.int8)
    packed = pack_to_int32(values, num_bits=4)
    assert packed.shape == (48, 32) and packed.dtype == torch.int32
    ours = unpack_int4(packed, 256)
    assert torch.equal(ours, values)
    assert torch.equal(ours, unpack_from_int32(packed, 4, torch.Size([48, 256])))


def test_compress_roundtrip_is_round_to_nearest():
    torch.manual_seed(0)
    weight = torch.randn(64, 256, dtype=torch.bfloat16)
    scheme = W4A16Int(group_size=128)
    tensors = scheme.compress(weight)
    assert tensors["weight_packed"].dtype == torch.int32
    assert tensors["weight_packed"].shape == (64, 32)
    assert tensors["weight_scale"].shape == (64, 2)
    assert tensors["weight_shape"].tolist() == [64, 256]
    dense = scheme.dequantize(tensors, torch.float32)
    scale = tensors["weight_scale"].float().repeat_interleave(128, dim=1)
    # Symmetric RTN: every weight is within half a step of its grid point. Slack: the scale
    # is stored in bf16 (relative error 2^-8, times at most 7.5 steps ~ 0.03 of a step).
    error = (dense - weight.float()).abs()
    assert (error <= scale * (0.5 + 0.04)).all()
    assert (error <= scale * 0.5 + 1e-6).float().mean() > 0.9
    # ...and the grid uses the int4 range: the largest magnitude in a group maps to +-7.5 steps at most.
    q = unpack_int4(tensors["weight_packed"], 256)
    assert q.min() >= -8 and q.max() <= 7 and (q.abs() >= 7).any()


def test_dequantize_matches_reference_formula():
    q = torch.randint(-8, 8, (4, 256), dtype=torch.int8)
    scale = torch.rand(4, 2, dtype=torch.float16) + 0.01
    dense = dequantize_int4(pack_to_int32(q, 4), scale, 256, torch.float32)
    expected = q.float() * scale.float().repeat_interleave(128, dim=1)
    assert torch.equal(dense, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_features, group", [(256, 128), (12, 4)])  # 12: the last int32 holds 4 padding codes
def test_dequantize_in_every_dtype_and_with_padding(dtype, in_features, group):
    """dequantize_int4 works in place on one output-dtype tensor: every dtype the learner computes in, and a row
    whose last int32 is half padding, give the reference formula (one rounding: code x scale in DTYPE)."""
    q = torch.randint(-8, 8, (6, in_features), dtype=torch.int8)
    scale = torch.rand(6, in_features // group, dtype=torch.bfloat16) + 0.01
    dense = dequantize_int4(pack_to_int32(q, 4), scale, in_features, dtype)
    assert dense.dtype == dtype and dense.shape == (6, in_features) and dense.is_contiguous()
    assert torch.equal(dense, q.to(dtype) * scale.to(dtype).repeat_interleave(group, dim=1))


def test_packed_nbytes_is_about_half_a_byte_per_weight():
    assert packed_nbytes(1024, 1024, 128, torch.bfloat16) == 1024 * 1024 // 2 + 1024 * 8 * 2
