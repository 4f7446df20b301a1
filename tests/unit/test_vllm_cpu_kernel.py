"""vLLM's CPU W4A16 kernel as the colocated learner calls it, and the inverse of its layout.

The repacked weights are made with vLLM's own repacking (`CPUWNA16LinearKernel`'s
`_process_gptq_weights_w4a16`, applied to a stand-in layer), so the test checks Orbit's
inverse against vLLM's layout, not against Orbit's idea of it.
"""

from __future__ import annotations

import pytest
import torch

from orbit_runtime.int4.vllm_cpu_kernel import dequantize_transposed, unpack_codes, wna16_linear


def vllm_repacked(codes_t: torch.Tensor) -> torch.Tensor:
    """Codes [in, out] (0..15) -> vLLM's repacked int32 [out / 16, in * 2], by vLLM's own code."""
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    class Config:
        weight_type = scalar_types.uint4b8

    class Layer(torch.nn.Module):
        pass

    layer = Layer()
    # GPTQ layout, input dim packed: [in / 8, out]
    layer.weight_packed = torch.nn.Parameter(pack_quantized_values_into_int32(codes_t, scalar_types.uint4b8, 0),
                                             requires_grad=False)  # fmt: skip
    layer.weight_scale = torch.nn.Parameter(torch.ones(1, codes_t.shape[1], dtype=torch.bfloat16), requires_grad=False)
    kernel = CPUWNA16LinearKernel.__new__(CPUWNA16LinearKernel)
    kernel.config, kernel.w_q_name, kernel.w_s_name = Config(), "weight_packed", "weight_scale"
    kernel._process_gptq_weights_w4a16(layer)
    return layer.weight_packed.data


@pytest.fixture
def repacked():
    generator = torch.Generator().manual_seed(0)
    in_features, out_features, group = 256, 96, 64
    codes_t = torch.randint(0, 16, (in_features, out_features), generator=generator, dtype=torch.int32)
    scale = torch.rand(in_features // group, out_features, generator=generator) * 0.02 + 0.001
    return codes_t, vllm_repacked(codes_t), scale


def test_the_inverse_reads_back_the_codes_vllm_packed(repacked):
    codes_t, packed, _ = repacked
    assert torch.equal(unpack_codes(packed, codes_t.shape[0]).to(torch.int32), codes_t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_computes_x_times_the_dequantized_weight(repacked, dtype):
    """cpu_gemm_wna16 on vLLM's layout equals x @ dequantize_transposed(...): the backward's W is the
    forward's W. Within rounding (the kernel accumulates in fp32 and rounds once)."""
    codes_t, packed, scale = repacked
    scale = scale.to(dtype)
    x = torch.randn(7, codes_t.shape[0], generator=torch.Generator().manual_seed(1)).to(dtype)
    dense_t = dequantize_transposed(packed, scale, torch.float32)
    expected = x.float() @ dense_t
    for isa in ("vec", "amx") if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() else ("vec",):
        y = wna16_linear(x, packed, scale, None, isa)
        assert y.dtype == dtype and y.shape == (7, codes_t.shape[1])
        torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)
        # rows are independent: one row at a time gives the same bits (what batch invariance needs)
        assert torch.equal(torch.cat([wna16_linear(x[i : i + 1], packed, scale, None, isa) for i in range(7)]), y)


def test_dequantize_is_codes_minus_eight_times_the_group_scale(repacked):
    codes_t, packed, scale = repacked
    dense_t = dequantize_transposed(packed, scale, torch.float32)
    group = codes_t.shape[0] // scale.shape[0]
    assert torch.equal(dense_t, (codes_t.float() - 8) * scale.repeat_interleave(group, dim=0))


def test_the_portable_kernel_computes_the_int4_linear_from_vllms_layout(repacked):
    """portable_gemm_wna16 (what serves INT4 on CPUs whose vLLM library lacks cpu_gemm_wna16) against
    the INT4 linear computed from the codes themselves, and against the native op where this CPU has it."""
    from orbit_runtime.int4.vllm_cpu_kernel import has_native_kernel, portable_gemm_wna16

    codes_t, packed, scale = repacked
    scale = scale.to(torch.float16)
    group = codes_t.shape[0] // scale.shape[0]
    x = torch.randn(5, codes_t.shape[0], generator=torch.Generator().manual_seed(2)).to(torch.float16)
    bias = torch.randn(codes_t.shape[1], generator=torch.Generator().manual_seed(3)).to(torch.float16)
    truth = x.float() @ ((codes_t.float() - 8) * scale.float().repeat_interleave(group, dim=0)) + bias.float()
    y = portable_gemm_wna16(input=x, q_weight=packed, scales=scale, zeros=None, bias=bias, pack_factor=8, isa_hint="vec")
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), truth, rtol=1e-3, atol=2e-3)  # one fp16 rounding of an fp32 result
    if has_native_kernel():  # an AVX-512 CPU: the two kernels agree
        from vllm import _custom_ops as ops

        assert ops.cpu_gemm_wna16 is not portable_gemm_wna16  # vLLM's own wrapper of its op, not the fallback
        native = ops.cpu_gemm_wna16(input=x, q_weight=packed, scales=scale, zeros=None, bias=bias, pack_factor=8, isa_hint="vec")
        torch.testing.assert_close(y.float(), native.float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(NotImplementedError, match="zero points"):
        portable_gemm_wna16(input=x, q_weight=packed, scales=scale, zeros=torch.zeros(1), bias=None, pack_factor=8)
