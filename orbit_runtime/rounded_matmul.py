"""A 16-bit matrix product with one rounding, fast on CPUs without native 16-bit GEMMs.

A 16-bit GEMM on CPU accumulates in fp32 and rounds the sum once to 16 bits (the product of
two 16-bit numbers is exact in fp32). On a CPU without native 16-bit GEMMs (no AVX-512 FP16 or
BF16, no AMX: e.g. an AVX2 AMD EPYC) PyTorch falls back to a generic loop that, at a LoRA
expand's shape (inner dimension = the rank), runs ~50-200x slower than the fp32 GEMM: measured
there, [128, 8] @ [8, 768] took 7 ms in fp16 or bf16 and 0.04 ms in fp32. Computing the same
product as an fp32 GEMM and rounding once gives the same numbers up to the summation order.

The rollout's LoRA fast path (rollout/vllm_cpu_lora.py) and the learner's vLLM-rounded LoRA
(learner/lora_numerics.py) both compute their expand with it, so the two stay one computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rounded_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in x's dtype (weight in x's dtype too); on CPU computed in fp32 and rounded once.

    Differentiable (the casts pass gradients through). On an accelerator the 16-bit GEMM itself
    runs: it is fast there, and the fp32 route would hold an fp32 copy of the output.
    """
    if x.dtype == torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight)
    return F.linear(x.float(), weight.float()).to(x.dtype)
