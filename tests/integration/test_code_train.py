"""`orbit train` with the code_tests reward on generated code tasks: every completion is run in
the sandbox, its pass rate is the reward, the groups' spread reaches the loss, and the samples
(prompt, completion, reward, advantage) are logged. Real vLLM, a real reference server, a
tiny random model: a one-character completion is a valid program (a digit) about 1 time in 10."""

from __future__ import annotations

import json

import pytest

from orbit_runtime.data.code_tasks import SYNTHETIC_STUB, CodeTask
from tests.orbit_train import train_job

pytestmark = pytest.mark.vllm


def test_the_code_reward_reaches_the_loss_and_its_samples_are_logged(tmp_path, int4_dir):
    job = {
        "model": {"path": str(int4_dir), "dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16},
        "data": {"type": "synthetic_code", "max_value": 9, "validation_size": 4},
        "rewards": [{"function": "code_tests", "kwargs": {"concurrency": 2, "wall_seconds": 5}}],
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_tokens": 1},
        "schedule": {"steps": 2, "learning_rate": 1e-3},
        "eval": {"every_steps": 10},
        "run": {"name": "code", "output_dir": str(tmp_path / "runs"), "log_samples": 64},
    }
    run_dir = train_job(tmp_path, job)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4 * 8
    for sample in samples:
        task = CodeTask.from_answer(sample["answer"])
        assert task.stub == SYNTHETIC_STUB and task.entry_point == "answer"
        program = SYNTHETIC_STUB + sample["completion"]
        value = int(task.tests.rsplit("== ", 1)[1])
        try:  # what the sandbox must have found, computed here without one (these programs are one character)
            namespace: dict = {}
            exec(program, namespace)  # noqa: S102 - a digit or a syntax error
            returned = namespace["answer"]()
            expected = (isinstance(returned, int) + (returned == value)) / 2
        except Exception:  # noqa: BLE001
            expected = 0.0
        assert sample["reward"] == expected, sample
    rewarded = [s for s in samples if s["reward"] > 0]
    assert rewarded, "no completion was a valid program: nothing was judged"
    assert any(s["advantage"] != 0 for s in samples), "the code reward never reached the loss"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert len(steps) == 2 and all(r["reward_errors"] == 0 for r in steps)
    for step in steps:  # every program judged is counted with its step, by status (held-out ones too, before step 1)
        counts = step["code_programs"]
        assert set(counts) <= {"ok", "syntax_error", "crashed", "timeout"} and sum(counts.values()) >= 4 * 8, counts
        assert counts.get("ok", 0) >= sum(s["reward"] > 0 for s in samples if s["step"] == step["step"])
