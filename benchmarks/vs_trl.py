"""Orbit vs TRL's GRPOTrainer, side by side, same settings, same CPU machine.

Both train a PEFT LoRA adapter (same rank, alpha and target modules) with GRPO: the same
group size, prompts per step, max completion tokens, temperature, learning rate and reward
(exact match on synthetic addition; a random model rarely earns it, which does not change
the cost of a step). Each system runs in its own process; the first step (compilation,
caches) is a warm-up and is not timed.
  orbit  INT4 base: vLLM (CPU build) generates, the packed-INT4 learner trains (bf16),
         the adapter is published and canary-verified every step
  trl    the 16-bit model in fp32 (TRL's best CPU setting: fp32, gradient checkpointing off,
         no vLLM - TRL's vLLM integration needs CUDA), generation with transformers
Workloads: `tiny` = the demo model, 8-token completions, 16 prompts x 8; `base` = a random
Qwen2-shape model of ~101M parameters, 128-token completions, 8 prompts x 8.

    python benchmarks/vs_trl.py --json bench-out/vs_trl.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json

WORKLOADS = {
    "tiny": {"shape": None, "max_tokens": 8, "prompts": 16, "group": 8},
    "base": {"shape": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 16}, "max_tokens": 128, "prompts": 8, "group": 8},
}
RANK, ALPHA, LR = 16, 32, 1e-5
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


def orbit_worker(name: str, int4: Path, steps: int, out: Path) -> dict:
    from orbit_runtime.config import parse_job_spec
    from orbit_runtime.trainer.loop import Trainer

    w = WORKLOADS[name]
    spec = parse_job_spec(
        {
            "model": {"path": str(int4), "dtype": "bf16", "learner_dtype": "bf16"},
            "adapter": {"rank": RANK, "alpha": ALPHA, "target_modules": TARGETS},
            "algorithm": {"kl_beta": 0.0},
            "data": {"type": "synthetic_arithmetic", "max_value": 99, "validation_size": 4},
            "rewards": [{"function": "exact_match"}],
            "rollout": {"group_size": w["group"], "prompts_per_step": w["prompts"], "max_tokens": w["max_tokens"],
                        "temperature": 1.0, "max_model_len": 512},
            "schedule": {"steps": steps + 1, "learning_rate": LR},
            "sync": {"canary_sequences": 2},
            "run": {"name": f"vs-trl-{name}", "output_dir": str(out)},
        }
    )  # fmt: skip
    trainer = Trainer(spec)
    trainer.start_roles()
    try:
        records = [trainer.step() for _ in range(steps + 1)][1:]  # first step: warm-up
    finally:
        trainer.stop_roles()
    breakdown = {}
    for key in ("generate_s", "train_s", "sync_s"):
        breakdown[key] = sum(r[key] for r in records) / len(records)
    step_s = sum(r["step_seconds"] for r in records) / len(records)
    breakdown["other_s"] = step_s - sum(breakdown.values())
    return {
        "samples_per_s": w["prompts"] * w["group"] / step_s,
        "step_s": step_s,
        "tokens_per_step": sum(r["tokens"] for r in records) / len(records),
        "breakdown": breakdown,
    }


def trl_worker(name: str, dense: Path, steps: int, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from orbit_runtime.config.spec import SyntheticArithmeticData
    from orbit_runtime.data.datasets import arithmetic_splits
    from orbit_runtime.rewards.builtin import exact_match

    w = WORKLOADS[name]
    splits = arithmetic_splits(SyntheticArithmeticData(max_value=99, validation_size=4, train_size=2000))
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": e.prompt}], "answer": e.answer} for e in splits.train]
    )

    def reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [v or 0.0 for v in exact_match(texts, answers=answer)]

    config = GRPOConfig(
        output_dir=str(out / f"trl-{name}"),
        per_device_train_batch_size=w["prompts"] * w["group"],
        gradient_accumulation_steps=1,
        num_generations=w["group"],
        max_completion_length=w["max_tokens"],
        temperature=1.0,
        learning_rate=LR,
        beta=0.0,
        max_steps=steps + 1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_vllm=False,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        seed=0,
    )
    times: dict[str, list[float]] = {"step": [], "generate": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            times["step"].append(time.monotonic() - self.started)

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
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
    step = times["step"][1:]
    generate = times["generate"][1 : len(times["step"])]
    step_s = sum(step) / len(step)
    generate_s = sum(generate) / len(generate)
    return {
        "samples_per_s": w["prompts"] * w["group"] / step_s,
        "step_s": step_s,
        "breakdown": {"generate_s": generate_s, "train_s": step_s - generate_s, "sync_s": 0.0, "other_s": 0.0},
        "settings": "fp32, gradient checkpointing off, transformers generate (no vLLM on CPU), beta=0",
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per system (after one warm-up step)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--worker", choices=["orbit", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run = orbit_worker if args.worker == "orbit" else trl_worker
        print(json.dumps(run(args.workload, args.model_dir, args.steps, args.out)))
        return {}

    result: dict = {"steps_timed": args.steps, "lora": {"rank": RANK, "alpha": ALPHA, "targets": TARGETS}}
    with tempfile.TemporaryDirectory(prefix="orbit-vs-trl-") as tmp:
        root = Path(tmp)
        for name in args.workloads:
            dense, int4, params = build_models(name, root)
            runs = {}
            for system, model_dir in (("orbit", int4), ("trl", dense)):
                command = [sys.executable, __file__, "--worker", system, "--workload", name, "--model-dir", str(model_dir),
                           "--steps", str(args.steps), "--out", str(root / "runs")]  # fmt: skip
                proc = subprocess.run(command, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"{system} on {name} failed:\n{proc.stderr[-4000:]}")
                runs[system] = json.loads(proc.stdout.strip().splitlines()[-1])
            w = WORKLOADS[name]
            result[name] = {
                "model_params": params,
                "prompts_per_step": w["prompts"],
                "group_size": w["group"],
                "max_completion_tokens": w["max_tokens"],
                "orbit_samples_per_s": round(runs["orbit"]["samples_per_s"], 3),
                "trl_samples_per_s": round(runs["trl"]["samples_per_s"], 3),
                "speedup": round(runs["orbit"]["samples_per_s"] / runs["trl"]["samples_per_s"], 2),
                "orbit": runs["orbit"],
                "trl": runs["trl"],
            }
    if "base" in result:
        result["speedup_base"] = result["base"]["speedup"]
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
