"""GPU check of the colocated backward's dequantization (torch only; the lent GPU machine has no vLLM).

`dequantize_transposed` reads vLLM's repacked W4A16 layout (int4/vllm_cpu_kernel.py). On a
GPU the colocated backward would run it on the device: this script checks that it gives the
CPU's result bitwise on CUDA (bf16 and fp16), that dX = dY @ W from it matches an fp32
reference, and times it against the dense matmul it feeds, at a 7168 x 2048 (DeepSeek-V3
expert-sized) and a 7168 x 18432 linear. Prints JSON. Not run in this task: no device was lent.

    python benchmarks/gpu_colocated_dequant.py --json gpu_colocated_dequant.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from orbit_runtime.int4.vllm_cpu_kernel import dequantize_transposed


def repacked(in_features: int, out_features: int, generator: torch.Generator) -> torch.Tensor:
    """Random codes in vLLM's repacked layout (int32 [out / 16, in * 2])."""
    return torch.randint(-(2**31), 2**31 - 1, (out_features // 16, in_features * 2), dtype=torch.int32, generator=generator)


def timed(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    generator = torch.Generator().manual_seed(0)
    results = []
    for in_features, out_features in ((7168, 2048), (7168, 18432)):
        packed = repacked(in_features, out_features, generator)
        for dtype in (torch.bfloat16, torch.float16):
            scale = (torch.rand(in_features // 128, out_features, generator=generator) * 0.02).to(dtype)
            cpu = dequantize_transposed(packed, scale, dtype)
            gpu_packed, gpu_scale = packed.cuda(), scale.cuda()
            gpu = dequantize_transposed(gpu_packed, gpu_scale, dtype)
            grad_y = torch.randn(512, out_features, generator=generator).to(dtype).cuda()
            dx = grad_y @ gpu.t()
            reference = grad_y.float().cpu() @ cpu.float().t()
            results.append({
                "shape": [in_features, out_features], "dtype": str(dtype).removeprefix("torch."),
                "bitwise_equal_to_cpu": bool(torch.equal(gpu.cpu(), cpu)),
                "dx_max_rel_error": float((dx.float().cpu() - reference).abs().max() / reference.abs().max()),
                "dequantize_ms": round(1e3 * timed(functools.partial(dequantize_transposed, gpu_packed, gpu_scale, dtype)), 3),
                "matmul_ms": round(1e3 * timed(functools.partial(torch.matmul, grad_y, gpu.t())), 3),
            })  # fmt: skip
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
