"""`orbit train` on an INT4 Qwen3-MoE base, as a user runs it: real vLLM (CPU build, Orbit's
plugin model), real reference server, LoRA on attention and every routed expert. Each step's
adapter sync is verified by the canary, a checkpoint lands each step, and a second run
resumes from the last one and trains on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.vllm


def _int4_demo(root: Path, arch: str) -> Path:
    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    quantize_checkpoint(write_demo_model(root / "src", seed=0, arch=arch), root / "int4", W4A16Int(group_size=128))
    return root / "int4"


@pytest.fixture(scope="module")
def moe_int4(tmp_path_factory) -> Path:
    return _int4_demo(tmp_path_factory.mktemp("moe-train"), "qwen3_moe")


@pytest.fixture(scope="module")
def deepseek_int4(tmp_path_factory) -> Path:
    return _int4_demo(tmp_path_factory.mktemp("deepseek-train"), "deepseek_v3")


# A dense reward a random model earns in varying amounts, so every group has variance and the
# adapter (attention and routed experts) moves at every step.
SHARE_OF_B = "def share_of_b(completions, **kwargs):\n    return [c.count('B') / max(len(c), 1) for c in completions]\n"


def _train(config: Path, *args: str) -> tuple[str, dict]:
    """Run `orbit train` (the job's reward plugin next to the config); its log and the JSON summary it prints last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(config.parent), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "train", str(config), *args],
                         capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr, json.loads(run.stdout.strip().splitlines()[-1])


def test_moe_grpo_syncs_checkpoints_and_resumes(moe_int4, tmp_path):
    job = {
        "model": {"path": str(moe_int4), "dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16, "routed_experts": True},
        "data": {"type": "synthetic_arithmetic", "max_value": 9, "validation_size": 4},
        "rewards": [{"function": "orbit_moe_rewards:share_of_b"}],
        "reference": {"mode": "server"},
        "algorithm": {"kl_beta": 0.05},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 6},
        "schedule": {"steps": 2, "learning_rate": 5e-3},
        "eval": {"every_steps": 10},
        "checkpoint": {"every_steps": 1},
        "run": {"name": "moe", "output_dir": str(tmp_path / "runs")},
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    (tmp_path / "orbit_moe_rewards.py").write_text(SHARE_OF_B)
    run_dir = tmp_path / "runs" / "moe"
    checkpoints = run_dir / "checkpoints"

    _train(config, "--max-steps", "1")
    adapter = checkpoints / "step-00000001" / "adapter" / "adapter_model.safetensors"
    from safetensors import safe_open

    with safe_open(adapter, "pt") as reader:
        expert_keys = [k for k in reader.keys() if ".mlp.experts." in k]
        moved = [k for k in expert_keys if "lora_B" in k and float(reader.get_tensor(k).abs().max()) > 0]
    assert len(expert_keys) == 4 * 8 * 3 * 2  # layers x experts x (gate, up, down) x (A, B): per-expert layout
    assert moved, "no routed expert's lora_B moved off PEFT's zero init: the canary compared the base with itself"

    _, summary = _train(config)  # resumes automatically from the newest checkpoint
    assert summary["resumed_from"] == f"file://{checkpoints}/step-00000001"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["adapter_version"] for s in steps] == [1, 2]
    for step in steps:  # every step's adapter reached vLLM and was verified on the canary batch, well inside its tolerance
        assert step["sync_attempts"] >= 1 and step["canary_mean_abs_dlogp"] < step["canary_tolerance"] / 2, step
        assert step["mismatch_mean_abs"] < 5e-3 and step["canary_decode_mean_abs_dlogp"] < 5e-3, step
    assert steps[1]["kl"] > 0  # the adapter moved away from the reference
    assert [r["from_step"] for r in rows if r["kind"] == "resume"] == [1]
    assert summary["steps"] == 2 and summary["canary_failures"] == 0
    assert (checkpoints / "step-00000002").is_dir()


def test_deepseek_grpo_with_routing_replay(deepseek_int4, tmp_path):
    """A DeepSeek-V3-style base (MLA attention, a dense first layer, a shared expert, group-limited
    sigmoid routing) served by vLLM's CPU build through Orbit's plugin model, with
    moe.routing_replay: vLLM returns every sample's experts, shaped [prompt + completion - 1,
    layers, k]; the learner replays them and reports routing agreement per MoE layer and the
    mismatch without replay. No sample falls back to the learner's own routing; every sync's
    canary passes (the adapter vLLM serves is the learner's)."""
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"]
    job = {
        "model": {"path": str(deepseek_int4), "dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16, "routed_experts": True, "target_modules": targets},
        "moe": {"routing_replay": True},
        "data": {"type": "synthetic_arithmetic", "max_value": 9, "validation_size": 4},
        "rewards": [{"function": "orbit_moe_rewards:share_of_b"}],
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 6},
        "schedule": {"steps": 2, "learning_rate": 5e-3},
        "eval": {"every_steps": 10},
        "run": {"name": "replay", "output_dir": str(tmp_path / "runs")},
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    (tmp_path / "orbit_moe_rewards.py").write_text(SHARE_OF_B)
    _, summary = _train(config)
    assert summary["steps"] == 2 and summary["canary_failures"] == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "replay" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert len(steps) == 2
    for step in steps:
        assert step["routing_missing_samples"] == 0, step  # every sample's routing came back, shaped right
        assert set(step["routing_agreement_by_layer"]) == {"1", "2", "3"}  # layer 0 is dense
        assert step["routing_agreement"] >= 0.98, step  # misaligned rows would agree by chance (~1/28)
        assert step["mismatch_unreplayed_mean_abs"] > 0 and 0 < step["mismatch_mean_abs"] < 1e-3, step  # measured ~2e-4
        assert step["canary_mean_abs_dlogp"] < step["canary_tolerance"] / 2, step
