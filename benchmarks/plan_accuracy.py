"""`orbit plan`'s learner bytes against a measured learner step, on this CPU.

A random Qwen2-shape model of >= 100M parameters (default 111M: hidden 768, 14 layers, vocab
32k), quantized to INT4 by `orbit quantize`'s code. Each configuration runs in a fresh process,
as `orbit train`'s learner does one step: the rollback snapshot (StepSnapshot), then
`learner.update.policy_update` (micro-batched forward, GRPO loss, backward, AdamW) on
PROMPTS x GROUP samples (prompts of 32-96 tokens, completions of --completion-tokens). It is
the learner's FIRST step, so AdamW allocates its moments in it, as the plan's first step says.

Measured, with glibc's mmap threshold pinned at 128 KiB (as benchmarks/memory.py does, so the
resident set tracks live tensors):
  step:  the resident-set high-water mark during the step (VmHWM, reset just before) minus the
         resident set just before it; planned: the first step's peak (orbit_runtime.plan.planner.
         learner_step: the snapshot and LoRA gradients, with activations + logits or, after them,
         AdamW's new moments; micro-batches filled to their token budget)
  total: the same peak minus the resident set before the model was loaded; planned: the base,
         the adapter's weights and the step's rows
Before either, each worker runs the same step on a tiny INT4 model of the same family with the
same settings, so the runtime's lazily loaded modules and kernel code pages are resident, as
in a learner that is running (they are the plan's `runtime` row, not the step's).
  base:  the loaded base's tensor bytes (Policy.base_memory) against the planned base rows
The baseline a LoRA user would otherwise reach for: weights + adapter state only (what
weights-and-optimizer calculators count), no activations or logits.

Every configuration runs --repeats times (fresh processes); the ratios' min, median and max
are reported.

    python benchmarks/plan_accuracy.py --json benchmarks/results/plan_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmark_output import emit_json
from learner_scale import MALLOC_PINNED, build_int4_model, make_batch, status_bytes

LONGEST_PROMPT = 96  # learner_scale.make_batch draws prompts of 32-96 tokens
CONFIGS = {
    # name: (micro_batch_tokens, gradient_checkpointing, learner dtype, LoRA rank)
    "checkpointing_4096_tokens": (4096, True, "bf16", 16),
    "checkpointing_1024_tokens": (1024, True, "bf16", 16),
    "no_checkpointing_2048_tokens": (2048, False, "bf16", 16),
    "fp32_learner_2048_tokens": (2048, True, "fp32", 16),
    "rank_128_2048_tokens": (2048, True, "bf16", 128),
}


def one_step(model_dir: Path, config: str, prompts: int, group: int, completion_tokens: int, measure: bool) -> dict:
    """A learner's first step on MODEL_DIR: the snapshot, then policy_update; with MEASURE, its memory."""
    import torch

    from orbit_runtime.algorithms.grpo import LossConfig
    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.micro_batches import MicroBatchLimits
    from orbit_runtime.learner.model import load_policy
    from orbit_runtime.learner.update import policy_update
    from orbit_runtime.trainer.rollback import StepSnapshot

    micro, checkpointing, dtype, rank = CONFIGS[config]
    before_load = status_bytes("VmRSS")
    policy = load_policy(model_dir, AdapterSpec(rank=rank, alpha=2 * rank), dtype=dtype)
    policy.set_gradient_checkpointing(checkpointing)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    batch = make_batch(prompts, group, completion_tokens, policy.model.config.vocab_size, seed=0)
    before_step = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    snapshot = StepSnapshot.capture(policy, optimizer, scheduler, {})
    result = policy_update(policy, optimizer, batch, LossConfig(max_tokens=completion_tokens), temperature=1.0,
                           max_grad_norm=1.0, limits=MicroBatchLimits(max_tokens=micro))  # fmt: skip
    peak = status_bytes("VmHWM")
    del snapshot
    if not measure:
        return {}
    base = policy.base_memory()
    return {"peak_rss_bytes": peak, "rss_before_load_bytes": before_load, "rss_before_step_bytes": before_step,
            "step_bytes": peak - before_step, "total_bytes": peak - before_load, "micro_batches": result.micro_batches,
            "base_tensor_bytes": base.packed_bytes + base.dense_bytes, "loss": result.loss}  # fmt: skip


def worker(args: argparse.Namespace) -> dict:
    """Warm up on a tiny INT4 model of the same family with the same settings (the runtime's lazily loaded
    modules and kernel code pages are then resident, as in a running learner), then measure the real one."""
    import gc

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    one_step(args.tiny_dir, args.config, 1, 2, 16, measure=False)
    gc.collect()
    return one_step(args.model_dir, args.config, args.prompts, args.group, args.completion_tokens, measure=True)


def planned(model_dir: Path, config: str, args: argparse.Namespace) -> dict:
    from orbit_runtime.plan.architecture import read_architecture
    from orbit_runtime.plan.planner import learner_step
    from orbit_runtime.plan.request import NodeSpec, PlanRequest
    from orbit_runtime.plan.roles import learner_rows
    from orbit_runtime.plan.weights import base_weights, quantization_of

    micro, checkpointing, dtype, rank = CONFIGS[config]
    request = PlanRequest(rank=rank, prompts=args.prompts, group=args.group, prompt_tokens=LONGEST_PROMPT,
                          completion_tokens=args.completion_tokens, micro_batch_tokens=micro, gradient_checkpointing=checkpointing,
                          learner_dtype=dtype, node=NodeSpec(gpus=0))  # fmt: skip
    arch = read_architecture(model_dir)
    step = learner_step(arch, request, first=True)
    rows = learner_rows(arch, base_weights(arch, quantization_of(arch, request)), request, cpu=True)
    base = rows["base_int4"] + rows["base_16bit"]
    adapter_weights = step.rows["lora_gradients"]  # fp32 weights: as many bytes as their gradients
    # the whole learner at its first step: the base, the adapter's weights, and what the step adds; the runtime
    # row (the process's libraries) is what the warm-up left resident before the model was loaded
    return {"step_bytes": step.peak, "total_bytes": base + adapter_weights + step.peak, "base_bytes": base,
            "naive_weights_and_optimizer_bytes": base + rows["lora"], "step_rows": step.rows, "learner_rows": rows}  # fmt: skip


def run_config(args: argparse.Namespace, model_dir: Path, tiny_dir: Path, config: str) -> dict:
    command = [sys.executable, __file__, "--worker", config, "--model-dir", str(model_dir), "--tiny-dir", str(tiny_dir), "--prompts", str(args.prompts),
               "--group", str(args.group), "--completion-tokens", str(args.completion_tokens)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **MALLOC_PINNED})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {config} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def spread(values: list[float]) -> dict:
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tiny-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.config = args.worker
        print(json.dumps(worker(args)))
        return

    results = {}
    with tempfile.TemporaryDirectory(prefix="orbit-plan-accuracy-") as tmp:
        model_dir, params = build_int4_model(Path(tmp) / "model", args.hidden, args.intermediate, args.layers, args.vocab)
        tiny_dir, _ = build_int4_model(Path(tmp) / "tiny", 128, 256, 1, 512)
        for config in args.configs:
            plan = planned(model_dir, config, args)
            runs = [run_config(args, model_dir, tiny_dir, config) for _ in range(args.repeats)]
            results[config] = {
                "settings": dict(zip(("micro_batch_tokens", "gradient_checkpointing", "learner_dtype", "lora_rank"), CONFIGS[config], strict=True)),
                "planned": plan,
                "measured": runs,
                "step_measured_over_planned": spread([r["step_bytes"] / plan["step_bytes"] for r in runs]),
                "total_measured_over_planned": spread([r["total_bytes"] / plan["total_bytes"] for r in runs]),
                "base_measured_over_planned": spread([r["base_tensor_bytes"] / plan["base_bytes"] for r in runs]),
                "naive_total_measured_over_planned": spread([r["total_bytes"] / plan["naive_weights_and_optimizer_bytes"] for r in runs]),
            }  # fmt: skip
            print(config, results[config]["step_measured_over_planned"], results[config]["total_measured_over_planned"], file=sys.stderr)
    worst = max(abs(r[k]["median"] - 1) for r in results.values() for k in ("step_measured_over_planned", "total_measured_over_planned"))
    emit_json({
        "model_params": params, "shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab")},
        "batch": {"prompts": args.prompts, "group": args.group, "prompt_tokens": [32, LONGEST_PROMPT], "completion_tokens": args.completion_tokens},
        "repeats": args.repeats, "configs": results, "worst_median_error": round(worst, 3), "within_25_percent": worst <= 0.25,
    }, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
