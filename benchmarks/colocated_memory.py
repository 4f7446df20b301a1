"""Memory of a whole run with one base in memory (placement colocated) vs two (separate).

The same `orbit train` job on the 398M-parameter Qwen2-shape model of benchmarks/memory.py
(INT4, bf16 activations, a few GRPO steps), once per placement, REPEATS times alternating.
Measured across all of the run's processes (the learner, vLLM's API server and its engine
core) as proportional set size from /proc/PID/smaps_rollup, so pages two processes share
count once:
  steady   the run's PSS right after each step's update (the trainer samples it there:
           the base, the KV cache and the adapter's state are all allocated, the update's
           activations freed), averaged over the steps
  peak     the largest PSS of the process tree sampled every 0.25 s over the whole run
  memfd    colocated: each process's PSS of the shared base's memory file; they add up to
           one copy
The base's storages across the run's processes:
  separate   vLLM's weight tensors (private memory: their bytes are their PSS; the same
             tensors, byte for byte, that the colocated engine moves into its memory file)
             + the learner's own copy (`learner_private_base_bytes` in the run's summary)
  colocated  the memory file's PSS summed over every process that maps it (smaps: each
             shared page once) + whatever base tensors the learner holds outside it
saved_fraction_of_base_copy = (separate - colocated) / one copy (vLLM's weight tensors).
1.0: the learner's copy is gone and nothing else was added. The whole-run PSS (steady,
peak) is reported beside it; on 2 CPU cores it varies by more than a base copy from run to
run (allocator retention, vLLM's scratch), which the per-repeat values show. Both runs use vLLM's W4A16 CPU kernel
(VLLM_CPU_INT4_W4A8=0), which colocated engines run: vLLM's default on AMX CPUs for bf16,
W4A8, lays the weights out differently, and the difference would not be the placement's.

    python benchmarks/colocated_memory.py --json benchmarks/results/colocated_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import yaml
from benchmark_output import emit_json
from memory import add_shape_arguments, build_model

from orbit_runtime.observability.process_memory import mapping_pss_bytes, process_tree, total_pss_bytes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build_base(tmp: Path, args: argparse.Namespace) -> tuple[Path, int]:
    """memory.py's random model, with the demo tokenizer (its ids are a subset of the vocabulary), in INT4."""
    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    dense, demo, int4 = tmp / "dense", tmp / "demo", tmp / "int4"
    params = build_model(dense, args)
    write_demo_model(demo, seed=0)
    for name in TOKENIZER_FILES:
        if (demo / name).exists():
            shutil.copy(demo / name, dense / name)
    quantize_checkpoint(dense, int4, W4A16Int(group_size=128))
    return int4, params


def job(model: Path, placement: str, out: Path, steps: int) -> Path:
    spec = {
        "model": {"path": str(model), "dtype": "bf16"},
        "placement": placement,
        "adapter": {"rank": 16, "alpha": 32},
        "learner": {"device": "cpu", "gradient_checkpointing": True},
        "data": {"type": "synthetic_arithmetic", "max_value": 9, "validation_size": 2},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_tokens": 16, "kv_cache_gib": 1, "max_model_len": 256},
        "schedule": {"steps": steps, "learning_rate": 1e-3},
        "eval": {"every_steps": 1000},
        "checkpoint": {"every_steps": 1000},
        "sync": {"decode_tokens": 0},
        "run": {"name": placement, "output_dir": str(out)},
    }
    path = out / f"{placement}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run(config: Path, placement: str) -> dict:
    """`orbit train CONFIG`, its process tree's PSS sampled until it exits."""
    # the same kernel (and weight layout) for both placements; glibc's mmap threshold pinned as in memory.py
    env = {**os.environ, "VLLM_CPU_INT4_W4A8": "0", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    proc = subprocess.Popen([sys.executable, "-m", "orbit_runtime.cli", "train", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    samples: list[int] = []
    memfd: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            pids = process_tree(proc.pid)
            samples.append(total_pss_bytes(pids))
            if placement == "colocated":
                split = {pid: mapping_pss_bytes(pid, "memfd:orbit-base") for pid in pids}
                if sum(split.values()) > sum(memfd.values()):
                    memfd.clear()
                    memfd.update(split)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    output, _ = proc.communicate(timeout=3600)
    done.set()
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"orbit train ({placement}) failed:\n{output[-3000:]}")
    run_dir = config.parent / placement
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "learner_private_base_bytes": summary["learner_private_base_bytes"],
        "steady_pss_bytes": int(statistics.mean(r["run_pss_update_phase_bytes"] for r in steps)),  # after each update
        "rollout_phase_pss_bytes": int(statistics.mean(r["run_pss_rollout_phase_bytes"] for r in steps)),
        "peak_pss_bytes": max(samples),
        "memfd_pss_by_process": sorted(memfd.values(), reverse=True),
        "shared_base_bytes": summary.get("shared_base_bytes"),
        "shared_base_unchanged": summary.get("shared_base_unchanged"),
        "steps": summary["steps"],
        "step_seconds": [round(r["step_seconds"], 2) for r in steps],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    add_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {"separate": [], "colocated": []}
    with tempfile.TemporaryDirectory(prefix="orbit-colocated-memory-") as tmp:
        model, params = build_base(Path(tmp), args)
        for repeat in range(args.repeats):
            for placement in ("separate", "colocated") if repeat % 2 == 0 else ("colocated", "separate"):
                out = Path(tmp) / f"run{repeat}"
                out.mkdir(exist_ok=True)
                runs[placement].append(run(job(model, placement, out, args.steps), placement))
    base_copy = runs["colocated"][0]["shared_base_bytes"]
    pairs = list(zip(runs["separate"], runs["colocated"], strict=True))
    storage = [{"separate_bytes": base_copy + s["learner_private_base_bytes"],
                "colocated_bytes": sum(c["memfd_pss_by_process"]) + c["learner_private_base_bytes"]} for s, c in pairs]  # fmt: skip
    fractions = [(b["separate_bytes"] - b["colocated_bytes"]) / base_copy for b in storage]
    steady = [(s["steady_pss_bytes"] - c["steady_pss_bytes"]) / base_copy for s, c in pairs]
    peaks = [(s["peak_pss_bytes"] - c["peak_pss_bytes"]) / base_copy for s, c in pairs]
    result = {
        "model_params": params,
        "shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab")},
        "steps": args.steps,
        "repeats": args.repeats,
        "base_copy_bytes": base_copy,
        "saved_fraction_of_base_copy": round(min(fractions), 3),  # the worst repeat
        "saved_fraction_of_base_copy_per_repeat": [round(f, 3) for f in fractions],
        "base_storage_per_repeat": storage,
        "whole_run_steady_saved_fraction_per_repeat": [round(f, 3) for f in steady],
        "whole_run_peak_saved_fraction_per_repeat": [round(f, 3) for f in peaks],
        "separate": runs["separate"],
        "colocated": runs["colocated"],
        "note": "vLLM's CPU build: the KV cache (rollout.kv_cache_gib) is allocated once and is not released during updates",
    }
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
