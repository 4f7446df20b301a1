"""Learning happens: GRPO on a tiny task raises the held-out reward by a wide margin in a few
steps, end to end (`orbit train`, real vLLM, adapter sync, greedy evaluation through the served
adapter). A regression in the loss sign, the advantages, the update or the sync breaks this
test, not only `make demo`. About a minute on 2 cores."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.integration.test_train import _orbit, _steps

pytestmark = pytest.mark.vllm

# The random demo model samples nearly uniformly from ~100 characters, so about 1 in 10 sampled
# characters is a digit (groups have reward variance), while its greedy answer is "BBBBBBBB"
# (held-out score 0): RL has to move the policy for the score to rise.
DIGITS = "def share_of_digits(completions, **kwargs):\n    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]\n"


def test_grpo_raises_the_heldout_reward(tmp_path, int4_dir):
    (tmp_path / "orbit_learning_rewards.py").write_text(DIGITS)
    reward = {"function": "orbit_learning_rewards:share_of_digits"}
    job = {
        "model": {"path": str(int4_dir), "dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16},
        "data": {"type": "synthetic_arithmetic", "max_value": 9, "validation_size": 8},
        "rewards": [reward],
        "eval": {"every_steps": 100, "reward": reward},  # before and after only
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_tokens": 8},
        "schedule": {"steps": 8, "learning_rate": 2e-2, "seed": 0},
        "checkpoint": {"every_steps": 100},
        "run": {"name": "learn", "output_dir": str(tmp_path / "runs")},
    }
    config = tmp_path / "learn.yaml"
    config.write_text(yaml.safe_dump(job))
    proc = _orbit("train", str(config), cwd=tmp_path, env_extra={"PYTHONPATH": str(tmp_path)})
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    run = tmp_path / "runs" / "learn"
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
    assert before < 0.2 and after > before + 0.5, summary
    rewards = [s["reward_mean"] for s in _steps(run)]
    assert sum(rewards[-2:]) > sum(rewards[:2]) + 0.2, rewards  # the sampled policy improved too
