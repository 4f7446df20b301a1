"""rounded_linear: the 16-bit product computed in fp32 and rounded once equals the 16-bit GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orbit_runtime.rounded_matmul import rounded_linear


def ulps_apart(x: torch.Tensor, y: torch.Tensor) -> int:
    return int((x.view(torch.int16).int() - y.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "rank", "out"), [(1, 8, 64), (128, 8, 768), (37, 16, 256)])
def test_a_lora_expand_matches_the_16_bit_gemm(dtype: torch.dtype, tokens: int, rank: int, out: int) -> None:
    g = torch.Generator().manual_seed(tokens + rank)
    x = torch.randn(tokens, rank, generator=g).to(dtype)
    w = (torch.randn(out, rank, generator=g) * 0.1).to(dtype)
    y = rounded_linear(x, w)
    assert y.dtype == dtype and y.shape == (tokens, out)
    assert ulps_apart(y, F.linear(x, w)) <= 1  # one rounding of an fp32 sum, as the 16-bit GEMM rounds


def test_gradients_pass_through_the_casts_and_fp32_is_left_alone() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    rounded_linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float().sum().backward()
    assert x.grad is not None and w.grad is not None and w.grad.abs().sum() > 0
    torch.testing.assert_close(w.grad, torch.ones(4, 16).t() @ x.detach(), rtol=2e-2, atol=2e-2)
    a, b = torch.randn(3, 5), torch.randn(7, 5)
    assert torch.equal(rounded_linear(a, b), F.linear(a, b))
