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
