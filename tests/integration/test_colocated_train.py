"""placement: colocated end to end (`orbit train`, real vLLM on CPU): one base in memory.

The learner trains on the rollout engine's own weight pages; adapters reach vLLM in memory
(no adapter files), verified by the canary each step; the base's bytes are unchanged after
the run; the run survives the engine being killed (the learner re-attaches to the new
engine's base and re-verifies it) and resumes exactly from a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.integration.test_checkpoint_resume import EXACT, _checkpoints
from tests.integration.test_train import _alive, _orbit, _steps, _wait_for

pytestmark = pytest.mark.vllm

# A dense reward the random demo model earns in varying amounts: the adapter moves every step.
DIGITS = "def share_of_digits(completions, **kwargs):\n    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]\n"


def _job(tmp_path, int4_dir, name: str, **overrides):
    reward = {"function": "orbit_colocated_rewards:share_of_digits"}
    job = {
        "model": {"path": str(int4_dir), "dtype": "fp16"},
        "placement": "colocated",
        "adapter": {"rank": 8, "alpha": 16},
        "data": {"type": "synthetic_arithmetic", "max_value": 9, "validation_size": 8},
        "rewards": [reward],
        "eval": {"every_steps": 100, "reward": reward},
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_tokens": 8},
        "schedule": {"steps": 8, "learning_rate": 2e-2, "seed": 0},
        "checkpoint": {"every_steps": 100},
        "run": {"name": "c", "output_dir": str(tmp_path / name)},
        **overrides,
    }
    (tmp_path / "orbit_colocated_rewards.py").write_text(DIGITS)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _train(config, *extra):
    return _orbit("train", str(config), *extra, cwd=config.parent, env_extra={"PYTHONPATH": str(config.parent)})


def test_colocated_run_learns_in_memory_and_survives_the_engine_dying(tmp_path, int4_dir):
    config = _job(tmp_path, int4_dir, "learn")
    run = tmp_path / "learn" / "c"
    proc = _train(config)
    try:
        _wait_for(lambda: len(_steps(run)) >= 3, 400, "three training steps")
        rollout_pid = json.loads((run / "processes.json").read_text())["rollout"]["pid"]
        os.kill(rollout_pid, signal.SIGKILL)  # the engine holding the only copy of the base dies mid-run
        output, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["placement"] == "colocated" and summary["steps"] == 8, summary
    assert summary["rollout_restarts"] == 1 and summary["shared_base_attaches"] == 2, summary
    assert summary["shared_base_unchanged"] is True  # nothing wrote to the base in 8 updates
    assert summary["shared_base_engine_on_shared_pages"] is True  # and vLLM still computes from those pages
    # the learner's own base memory is the rotary tables: everything else is the engine's pages
    assert summary["learner_private_base_bytes"] < 0.01 * summary["shared_base_bytes"], summary
    assert summary["heldout_accuracy_before"] < 0.2 and summary["heldout_accuracy_after"] > 0.7, summary
    steps = _steps(run)
    assert [s["adapter_version"] for s in steps] == list(range(1, 9))
    assert all(s["canary_verdict"] in ("verified", "inconclusive") for s in steps)
    assert any(s["canary_verdict"] == "verified" for s in steps)
    # learner and engine compute the linear layers with one kernel on one copy: a tight mismatch
    assert all(s["mismatch_mean_abs"] < 2e-3 for s in steps), [s["mismatch_mean_abs"] for s in steps]
    assert not any((run / "adapters").iterdir()), "colocated sync wrote adapter files"
    # memory by phase, counted across the run's processes; on CPU nothing is released for the update
    assert all(s["run_pss_rollout_phase_bytes"] > 0 and s["run_pss_update_phase_bytes"] > 0 for s in steps)
    assert not any(s["kv_cache_released"] for s in steps)
    assert "placement colocated: the learner computes on the rollout engine's base" in output
    assert not _alive(json.loads((run / "processes.json").read_text())["rollout"]["pid"])


def test_colocated_resume_continues_exactly(tmp_path, int4_dir):
    steps = {"steps": 4, "learning_rate": 5e-3, "warmup_steps": 3, "seed": 0}
    checkpoint = {"every_steps": 2, "keep_last": 5}
    # vLLM one sequence at a time: its log-probs must not depend on request timing (test_checkpoint_resume.EXACT)
    rollout = {"group_size": 8, "prompts_per_step": 2, "max_tokens": 8, **EXACT}  # 16 sequences, one by one
    straight = _job(tmp_path, int4_dir, "straight", schedule=steps, checkpoint=checkpoint, rollout=rollout)
    proc = _train(straight)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]

    resumed = _job(tmp_path, int4_dir, "resumed", schedule=steps, checkpoint=checkpoint, rollout=rollout)
    run = tmp_path / "resumed" / "c"
    proc = _train(resumed)
    try:
        uri = f"file://{run / 'checkpoints'}"
        _wait_for(lambda: any(c["complete"] and c["step"] == 2 for c in _checkpoints(uri, {})), 400, "the step-2 checkpoint")
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    proc = _train(resumed, "--resume")
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert "resuming from" in output
    a, b = _steps(tmp_path / "straight" / "c"), _steps(run)
    assert [s["step"] for s in b] == [1, 2, 3, 4]
    for key in ("prompt_indices", "learning_rate", "reward_mean"):
        assert [s[key] for s in b] == [s[key] for s in a], key
    final_a = load_file(tmp_path / "straight" / "c" / "checkpoints" / "step-00000004" / "adapter" / "adapter_model.safetensors")
    final_b = load_file(run / "checkpoints" / "step-00000004" / "adapter" / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for k, t in final_a.items() if "lora_B" in k)
    for key in final_a:
        torch.testing.assert_close(final_b[key], final_a[key], rtol=1e-5, atol=1e-6)
