"""INT4 dequantization, Orbit's in-place version vs the stack-and-cast one it replaced.

Every INT4 linear dequantizes its weight on each call: the learner in forward and backward
(`packing.dequantize_int4`, compressed-tensors' layout) and, on CPUs without AVX-512 where
vLLM's wheel has no `cpu_gemm_wna16`, vLLM's rollout too (`vllm_cpu_kernel.dequantize_transposed`,
vLLM's repacked layout). The previous version unpacked to uint8, stacked the nibbles, cast,
subtracted and scaled, each step a new tensor; the current one writes the nibbles into one
tensor of the output dtype and shifts and scales it in place (`packing.signed_codes`). Both
are timed side by side on the linears of vs_trl's `base` model, with an fp32 matmul of a
64-row batch (`base`'s decode batch) for scale; each row records whether the two agree bit
for bit (the script fails if any does not).

    python benchmarks/int4_dequant.py --json benchmarks/results/int4_dequant.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from benchmark_output import emit_json

from orbit_runtime.int4.packing import dequantize_int4
from orbit_runtime.int4.vllm_cpu_kernel import BLOCK_OUTPUTS, dequantize_transposed

SHAPES = [(2048, 768), (768, 2048), (768, 768)]  # [out, in]: base's MLP up/gate, down, attention
GROUP, CALLS, ROUNDS, ROWS = 128, 50, 3, 64


def previous_dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """packing.dequantize_int4 as it was before signed_codes (commit 3520e22)."""
    as_bytes = packed.view(torch.uint8)
    nibbles = torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).view(packed.shape[0], -1)
    q = (nibbles[:, :in_features].view(torch.int8) - 8).to(dtype)
    out_features, groups = scale.shape
    return (q.view(out_features, groups, -1) * scale.to(dtype).unsqueeze(-1)).view(out_features, in_features)


def previous_dequantize_transposed(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """vllm_cpu_kernel.dequantize_transposed as it was before signed_codes (commit 3520e22)."""
    groups, out_features = scale.shape
    in_features, blocks = packed.shape[1] // 2, packed.shape[0]
    by_input = packed.view(blocks, in_features, 2).permute(1, 0, 2).reshape(in_features, blocks * BLOCK_OUTPUTS // 8)
    as_bytes = by_input.contiguous().view(torch.uint8)
    codes = torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).view(in_features, out_features)
    codes = codes.to(dtype).view(groups, in_features // groups, out_features)
    return ((codes - 8) * scale.to(dtype).unsqueeze(1)).view(in_features, out_features)


def timed_ms(call, calls: int) -> list[float]:
    call()  # warm-up
    seconds = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        seconds.append(1e3 * (time.perf_counter() - t))
    return seconds


def summary(ms: list[float]) -> dict:
    return {"median_ms": round(statistics.median(ms), 4), "min_ms": round(min(ms), 4), "max_ms": round(max(ms), 4),
            "stdev_ms": round(statistics.stdev(ms), 4)}  # fmt: skip


def measure(calls: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    rows = []
    for out_features, in_features in SHAPES:
        learner_packed = torch.randint(-(2**31), 2**31 - 1, (out_features, in_features // 8), dtype=torch.int32)
        learner_scale = torch.rand(out_features, in_features // GROUP, dtype=torch.bfloat16)
        vllm_packed = torch.randint(-(2**31), 2**31 - 1, (out_features // BLOCK_OUTPUTS, in_features * 2), dtype=torch.int32)
        vllm_scale = torch.rand(in_features // GROUP, out_features, dtype=torch.bfloat16)
        for dtype in (torch.float32, torch.bfloat16):
            cases = {
                "learner": (partial(previous_dequantize_int4, learner_packed, learner_scale, in_features, dtype),
                            partial(dequantize_int4, learner_packed, learner_scale, in_features, dtype)),
                "vllm_portable": (partial(previous_dequantize_transposed, vllm_packed, vllm_scale, dtype),
                                  partial(dequantize_transposed, vllm_packed, vllm_scale, dtype)),
            }  # fmt: skip
            for layout, (previous, current) in cases.items():
                equal = torch.equal(previous(), current())
                before, after = [], []
                for _ in range(rounds):  # interleaved, so drift hits both alike
                    before += timed_ms(previous, calls)
                    after += timed_ms(current, calls)
                rows.append({"layout": layout, "out": out_features, "in": in_features, "dtype": str(dtype).split(".")[-1],
                             "bitwise_equal": equal, "previous": summary(before), "current": summary(after),
                             "speedup": round(statistics.median(before) / statistics.median(after), 2)})  # fmt: skip
        x = torch.randn(ROWS, in_features)
        weight_t = dequantize_transposed(vllm_packed, vllm_scale, torch.float32)
        rows.append({"layout": f"fp32 matmul of {ROWS} rows (for scale)", "out": out_features, "in": in_features,
                     "dtype": "float32", "current": summary(timed_ms(partial(torch.matmul, x, weight_t), calls * rounds))})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=CALLS, help="timed calls per round and version")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = measure(args.calls, args.rounds)
    emit_json({"threads": torch.get_num_threads(), "rows": rows}, args.json)
    if not all(row.get("bitwise_equal", True) for row in rows):
        raise SystemExit("the two versions differ (rows with bitwise_equal false)")


if __name__ == "__main__":
    main()
