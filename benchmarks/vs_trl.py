"""Orbit vs TRL's GRPOTrainer, side by side, same settings, same CPU machine.

Both train a PEFT LoRA adapter (same rank, alpha and target modules) with GRPO: the same
group size, prompts per step, max completion tokens, temperature, learning rate and reward
(exact match on synthetic addition; a random model rarely earns it, which does not change
the cost of a step). Each configuration runs in its own process; its first step
(compilation, caches) is a warm-up and is not timed; --steps steps are timed, and the spread
over them is reported. TRL runs with gradient checkpointing off (its best CPU setting), and so
does every Orbit configuration from `no_gradient_checkpointing` on (the two before it keep
Orbit's default, on, as the earlier result did).
  orbit  INT4 base: vLLM (CPU build) generates, the packed-INT4 learner trains, the adapter is
         published and canary-verified every step. ORBIT_CONFIGS are the levers tried, one
         added at a time (the first is the configuration of the earlier committed result):
         each one's effect is in `levers`.
  trl    the 16-bit model, generation with transformers (TRL's vLLM integration needs CUDA).
         TRL_CONFIGS: fp32 and bf16 measured, and its generation options (paged generation,
         a static KV cache) tried in fp32, its faster dtype on CPUs without AVX-512 BF16;
         top_k 0 (off, TRL's default) and generation_kwargs empty in all, as in Orbit's
         sampling (temperature 1, no top-k/top-p).
The headline `speedup` compares each side at its measured best (the fastest configuration by
samples/s); tokens/s counts completion tokens, which both sides record (a random model runs
most completions to the max). Workloads: `tiny` = the demo model, 8-token completions, 16
prompts x 8; `base` = a random Qwen2-shape model of ~101M parameters, 128-token completions,
8 prompts x 8.

    python benchmarks/vs_trl.py --json benchmarks/results/vs_trl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json

WORKLOADS = {
    "tiny": {"shape": None, "max_tokens": 8, "prompts": 16, "group": 8},
    "base": {
        "shape": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 16},
        "max_tokens": 128,
        "prompts": 8,
        "group": 8,
    },
}
RANK, ALPHA, LR = 16, 32, 1e-5
# Orbit's levers, cumulative: each adds one change to the one before (the first: the earlier committed result's setting)
ORBIT_CONFIGS = {
    "committed_setting": {"lora_fast_path": False, "gradient_checkpointing": True, "learner_dtype": "bf16", "dtype": "bf16",
                          "vllm_idle_spin_s": 1.0, "vllm_reserved_cpus": 1,  # vLLM's own defaults
                          "pin_malloc_threshold": True},  # fmt: skip
    "lora_fast_path": {"lora_fast_path": True},
    "no_gradient_checkpointing": {"gradient_checkpointing": False},
    "fp32_learner": {"learner_dtype": "fp32"},
    # vLLM's processes busy-poll for 1 s after every message (its default, kept above); Orbit's default: sleep at once
    "no_idle_spin": {"vllm_idle_spin_s": 0.0},
    # vLLM's CPU worker leaves one core to its engine process (VLLM_CPU_NUM_OF_RESERVED_CPU: on 2 cores it
    # computes on 1); Orbit's phases take turns, so the worker may take every core. Opt-in, not Orbit's default:
    # on two threads vLLM's log-probs differ from call to call (tests/integration/test_rollout_determinism.py)
    "rollout_all_cores": {"vllm_reserved_cpus": 0},
    # glibc's mmap threshold left dynamic in the learner (learner.pin_malloc_threshold false): pinned at 4 MiB,
    # every freed activation above it goes back to the OS and is page-faulted in again by the next layer
    "no_malloc_pin": {"pin_malloc_threshold": False},
    # Intel's OpenMP runtime (shipped in the venv with vLLM's CPU wheel) preloaded, as vLLM's CPU docs advise
    "rollout_iomp": {"vllm_iomp": True},
    "fp16_rollout": {"dtype": "fp16"},  # lost on both workloads (LOST: later levers do not carry it)
}
LOST = {"rollout_iomp", "fp16_rollout"}  # measured slower: applied to their own row only, not carried to later ones
SYNC_PARTS = ("sync_publish_s", "sync_canary_expected_s", "sync_seconds", "sync_decode_canary_s")  # sync_seconds: load + verify
TRL_CONFIGS = {
    "fp32": {"bf16": False},
    "bf16": {"bf16": True},
    "fp32_paged_generation": {"bf16": False, "use_transformers_paged": True},
    "fp32_static_cache": {"bf16": False, "cache_implementation": "static"},
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_models(name: str, root: Path) -> tuple[Path, Path, int]:
    """The workload's 16-bit model (demo tokenizer) and its INT4 copy; returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    dense = write_demo_model(root / f"{name}-dense", seed=0)
    shape = WORKLOADS[name]["shape"]
    if shape:
        demo = Qwen2Config.from_pretrained(dense)  # keep the demo tokenizer's vocabulary and special ids
        config = Qwen2Config(
            vocab_size=demo.vocab_size, eos_token_id=demo.eos_token_id, pad_token_id=demo.pad_token_id,
            bos_token_id=None, tie_word_embeddings=False, max_position_embeddings=1024,
            num_attention_heads=shape["hidden_size"] // 64, num_key_value_heads=4, **shape,
        )  # fmt: skip
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(dense)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(dense).parameters())
    quantize_checkpoint(dense, root / f"{name}-int4", W4A16Int(group_size=128))
    return dense, root / f"{name}-int4", params


def orbit_settings(config: str) -> dict:
    """ORBIT_CONFIGS[CONFIG] with every lever before it applied, except those that LOST."""
    settings: dict = {}
    for name, change in ORBIT_CONFIGS.items():
        if name == config:
            return {**settings, **change}
        if name not in LOST:
            settings.update(change)
    raise KeyError(config)


def intel_openmp() -> Path:
    """libiomp5.so of the intel-openmp package (a dependency of vLLM's CPU wheel): in the venv's lib/."""
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no Intel OpenMP runtime in this environment (pip install intel-openmp)")
    return path


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}  # fmt: skip


def orbit_worker(name: str, int4: Path, steps: int, out: Path, config: str) -> dict:
    import os

    from orbit_runtime.config import parse_job_spec
    from orbit_runtime.rollout.server import RESERVED_CPUS_ENV
    from orbit_runtime.rollout.vllm_cpu_idle import IDLE_SPIN_ENV
    from orbit_runtime.rollout.vllm_cpu_lora import FAST_PATH_ENV
    from orbit_runtime.trainer.loop import Trainer

    w, settings = WORKLOADS[name], orbit_settings(config)
    os.environ[FAST_PATH_ENV] = "1" if settings["lora_fast_path"] else "0"  # read by the vLLM server this starts
    os.environ[IDLE_SPIN_ENV] = str(settings["vllm_idle_spin_s"])
    os.environ[RESERVED_CPUS_ENV] = str(settings["vllm_reserved_cpus"])  # 1: vLLM's own choice on one x86 worker
    if settings.get("vllm_iomp"):
        os.environ["LD_PRELOAD"] = str(intel_openmp())
    spec = parse_job_spec(
        {
            "model": {"path": str(int4), "dtype": settings["dtype"], "learner_dtype": settings["learner_dtype"]},
            "adapter": {"rank": RANK, "alpha": ALPHA, "target_modules": TARGETS},
            "learner": {"gradient_checkpointing": settings["gradient_checkpointing"],
                        "pin_malloc_threshold": settings["pin_malloc_threshold"]},
            "algorithm": {"kl_beta": 0.0},
            "data": {"type": "synthetic_arithmetic", "max_value": 99, "validation_size": 4},
            "rewards": [{"function": "exact_match"}],
            "rollout": {"group_size": w["group"], "prompts_per_step": w["prompts"], "max_tokens": w["max_tokens"],
                        "temperature": 1.0, "max_model_len": 512},
            "schedule": {"steps": steps + 1, "learning_rate": LR},
            "sync": {"canary_sequences": 2},
            "run": {"name": f"vs-trl-{name}-{config}".replace("_", "-"), "output_dir": str(out)},
        }
    )  # fmt: skip
    trainer = Trainer(spec)
    trainer.start_roles()
    try:
        records = [trainer.step() for _ in range(steps + 1)][1:]  # first step: warm-up
    finally:
        trainer.stop_roles()
    step_s = [r["step_seconds"] for r in records]
    breakdown = {key: statistics.fmean(r[key] for r in records) for key in ("generate_s", "train_s", "sync_s")}
    breakdown["other_s"] = statistics.fmean(step_s) - sum(breakdown.values())
    breakdown["sync_parts"] = {key: statistics.fmean(r[key] for r in records) for key in SYNC_PARTS if records[0].get(key) is not None}
    tokens = [r["tokens"] for r in records]
    return {
        "settings": settings,
        "samples_per_s": w["prompts"] * w["group"] / statistics.fmean(step_s),
        "tokens_per_s": sum(tokens) / sum(step_s),
        "step_s": spread(step_s),
        "completion_tokens_per_step": spread(tokens),
        "breakdown": breakdown,
    }


def trl_worker(name: str, dense: Path, steps: int, out: Path, config: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from orbit_runtime.config.prompt_data import SyntheticArithmeticData
    from orbit_runtime.data.datasets import arithmetic_splits
    from orbit_runtime.rewards.builtin import exact_match

    w, options = WORKLOADS[name], TRL_CONFIGS[config]
    splits = arithmetic_splits(SyntheticArithmeticData(max_value=99, validation_size=4, train_size=2000))
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": e.prompt}], "answer": e.answer} for e in splits.train])

    def reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [v or 0.0 for v in exact_match(texts, answers=answer)]

    config_args = dict(
        output_dir=str(out / f"trl-{name}-{config}"),
        per_device_train_batch_size=w["prompts"] * w["group"],
        gradient_accumulation_steps=1,
        num_generations=w["group"],
        max_completion_length=w["max_tokens"],
        temperature=1.0,
        top_k=0,
        learning_rate=LR,
        beta=0.0,
        max_steps=steps + 1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_vllm=False,
        gradient_checkpointing=False,
        use_cpu=True,
        seed=0,
        **options,
    )  # fmt: skip
    times: dict[str, list[float]] = {"step": [], "generate": [], "tokens": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            times["step"].append(time.monotonic() - self.started)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:  # per step (logging_steps=1), over all its completions
                times["tokens"].append(logs["completions/mean_length"] * w["prompts"] * w["group"])

    dtype = torch.bfloat16 if options.get("bf16") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=dtype)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**config_args),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(dense),
        peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, task_type="CAUSAL_LM"),
        callbacks=[StepTimer()],
    )
    original_generate = trainer._generate

    def timed_generate(*args, **kwargs):
        started = time.monotonic()
        try:
            return original_generate(*args, **kwargs)
        finally:
            times["generate"].append(time.monotonic() - started)

    trainer._generate = timed_generate
    trainer.train()
    step_s = times["step"][1:]
    generate_s = statistics.fmean(times["generate"][1 : len(times["step"])])
    tokens = times["tokens"][1 : len(times["step"])]
    return {
        "settings": {"dtype": "bf16" if options.get("bf16") else "fp32", "gradient_checkpointing": False, "top_k": 0,
                     "generation": "transformers generate (no vLLM on CPU)", **options},
        "samples_per_s": w["prompts"] * w["group"] / statistics.fmean(step_s),
        "tokens_per_s": sum(tokens) / sum(step_s) if tokens else None,
        "step_s": spread(step_s),
        "completion_tokens_per_step": spread(tokens) if tokens else None,
        "breakdown": {"generate_s": generate_s, "train_s": statistics.fmean(step_s) - generate_s, "sync_s": 0.0, "other_s": 0.0},
    }  # fmt: skip


def run_config(system: str, name: str, model_dir: Path, steps: int, out: Path, config: str) -> dict:
    """One configuration in a fresh process; a failure is recorded, not fatal (e.g. a TRL option this version lacks)."""
    command = [sys.executable, __file__, "--worker", system, "--workload", name, "--model-dir", str(model_dir),
               "--steps", str(steps), "--out", str(out), "--config", config]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        print(f"{system} {config} on {name} failed:\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
        return {"error": tail}
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{system} {config} on {name}: {run['samples_per_s']:.3f} samples/s", file=sys.stderr, flush=True)
    return run


def levers(runs: dict[str, dict]) -> list[dict]:
    """Each Orbit lever's measured effect: step time before and after adding it (before: the last
    lever kept, as `orbit_settings` builds each configuration)."""
    table, previous = [], None
    for config, run in runs.items():
        if "error" in run:
            table.append({"lever": config, "error": run["error"]})
            if config not in LOST:
                previous = None  # the next lever's ratio would span two changes
            continue
        row = {"lever": config, "step_s": round(run["step_s"]["mean"], 3), "step_s_stdev": round(run["step_s"]["stdev"], 3),
               **{k: round(v, 3) if isinstance(v, float) else {part: round(x, 3) for part, x in v.items()}
                  for k, v in run["breakdown"].items()}}  # fmt: skip
        if previous is not None:
            row["speedup_vs_previous"] = round(previous / run["step_s"]["mean"], 3)
        if config not in LOST:
            previous = run["step_s"]["mean"]
        table.append(row)
    return table


def best(runs: dict[str, dict]) -> str | None:
    """The fastest configuration that ran (None: none did)."""
    ran = [c for c in runs if "error" not in runs[c]]
    return max(ran, key=lambda c: runs[c]["samples_per_s"]) if ran else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up step)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--orbit-configs", nargs="+", default=list(ORBIT_CONFIGS), choices=list(ORBIT_CONFIGS))
    parser.add_argument("--trl-configs", nargs="+", default=list(TRL_CONFIGS), choices=list(TRL_CONFIGS))
    parser.add_argument("--worker", choices=["orbit", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run = orbit_worker if args.worker == "orbit" else trl_worker
        print(json.dumps(run(args.workload, args.model_dir, args.steps, args.out, args.config)))
        return {}

    result: dict = {"steps_timed": args.steps, "lora": {"rank": RANK, "alpha": ALPHA, "targets": TARGETS}}
    with tempfile.TemporaryDirectory(prefix="orbit-vs-trl-") as tmp:
        root = Path(tmp)
        for name in args.workloads:
            dense, int4, params = build_models(name, root)
            orbit = {c: run_config("orbit", name, int4, args.steps, root / "runs", c) for c in args.orbit_configs}
            trl = {c: run_config("trl", name, dense, args.steps, root / "runs", c) for c in args.trl_configs}
            w, orbit_best, trl_best = WORKLOADS[name], best(orbit), best(trl)
            if orbit_best is None or trl_best is None:  # keep what ran: the errors say why
                result[name] = {"error": "no configuration of one side ran", "orbit": orbit, "trl": trl}
                continue
            result[name] = {
                "model_params": params, "prompts_per_step": w["prompts"], "group_size": w["group"],
                "max_completion_tokens": w["max_tokens"],
                "orbit_best": orbit_best, "trl_best": trl_best,
                "orbit_samples_per_s": round(orbit[orbit_best]["samples_per_s"], 3),
                "trl_samples_per_s": round(trl[trl_best]["samples_per_s"], 3),
                "speedup": round(orbit[orbit_best]["samples_per_s"] / trl[trl_best]["samples_per_s"], 2),
                "speedup_tokens_per_s": round(orbit[orbit_best]["tokens_per_s"] / trl[trl_best]["tokens_per_s"], 2)
                if trl[trl_best].get("tokens_per_s") else None,
                "levers": levers(orbit),
                "orbit": orbit,
                "trl": trl,
            }  # fmt: skip
    for name in ("base", "tiny"):
        if name in result and "speedup" in result[name]:
            result[f"speedup_{name}"] = result[name]["speedup"]
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
