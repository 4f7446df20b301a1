"""`orbit train` end to end, as a user runs it: a real learner process, a real vLLM server,
a real reference server. Faults are injected from outside, the way they happen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml

from orbit_runtime.processes import free_port

pytestmark = pytest.mark.vllm

FRAGILE_REWARD = textwrap.dedent(
    """
    def fragile(completions, **kwargs):
        if any("7" in c for c in completions):
            raise RuntimeError("reward backend exploded")
        return [0.1 for _ in completions]

    def share_of_b(completions, **kwargs):  # dense: every group varies, so the adapter moves at every step
        return [c.count("B") / max(len(c), 1) for c in completions]

    def always_fails(completions, **kwargs):
        raise RuntimeError("reward backend down")
    """
)


def _job(tmp_path: Path, int4_dir: Path, **overrides) -> Path:
    job = {
        "model": {"path": str(int4_dir), "dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16},
        "data": {"type": "synthetic_arithmetic", "max_value": 9, "validation_size": 8},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 6},
        "schedule": {"steps": 4, "learning_rate": 1e-3},
        "eval": {"every_steps": 2},
        "run": {"name": "t", "output_dir": str(tmp_path / "runs")},
    }
    for key, value in overrides.items():
        job[key] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _orbit(*args: str, cwd: Path, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "orbit_runtime.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _steps(run: Path) -> list[dict]:
    if not (run / "metrics.jsonl").exists():
        return []
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "step"]


def test_run_survives_rollout_and_reference_death_and_a_raising_reward(tmp_path, int4_dir):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "fragile_rewards.py").write_text(FRAGILE_REWARD)
    config = _job(
        tmp_path, int4_dir,
        rewards=[{"function": "exact_match"}, {"function": "fragile_rewards:share_of_b"},
                 {"function": "fragile_rewards:fragile", "max_error_fraction": 1.0}],
        reference={"mode": "server"},
        algorithm={"kl_beta": 0.05},
        schedule={"steps": 5, "learning_rate": 5e-3},
        eval={"every_steps": 2, "samples": 2},
    )  # fmt: skip
    run = tmp_path / "runs" / "t"
    proc = _orbit("train", str(config), cwd=tmp_path, env_extra={"PYTHONPATH": str(tmp_path / "plugins")})
    try:
        _wait_for(lambda: len(_steps(run)) >= 2, 300, "two training steps")
        roles = json.loads((run / "processes.json").read_text())
        os.kill(roles["rollout"]["pid"], signal.SIGKILL)  # the rollout server dies mid-run
        _wait_for(lambda: len(_steps(run)) >= 3, 300, "a step after the rollout restart")
        os.kill(roles["reference"]["pid"], signal.SIGKILL)  # and then the reference server
        output, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["rollout_restarts"] == 1 and summary["reference_restarts"] == 1, summary
    assert summary["reward_errors"] > 0  # the raising reward was isolated and counted
    steps = _steps(run)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert [s["adapter_version"] for s in steps] == [1, 2, 3, 4, 5]
    # the dense reward moves the adapter every step: the reference server's KL is positive after the first
    assert all(s["reference_s"] > 0 for s in steps) and all(s["kl"] > 0 for s in steps[1:]), [s["kl"] for s in steps]
    from safetensors.torch import load_file

    lora_b = [t for k, t in load_file(run / "adapters" / "v5" / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and all(float(t.abs().max()) > 0 for t in lora_b)  # PEFT starts lora_B at 0: it moved
    # learner (fp32) and vLLM (fp16) agree far inside the canary's tolerance, on both paths
    for s in steps:
        assert s["mismatch_mean_abs"] < 5e-3 and s["canary_decode_mean_abs_dlogp"] < 5e-3, s
        assert s["canary_mean_abs_dlogp"] < s["canary_tolerance"] / 2, s
        assert s["canary_verdict"] in ("verified", "inconclusive"), s
    assert any(s["canary_verdict"] == "verified" for s in steps)  # the adapter moved more than the noise
    assert 0 < summary["canary_noise_floor"] < 5e-3
    # evaluation with error bars: 2 samples a prompt, mean@2 and pass@2
    assert summary["heldout_samples_per_prompt"] == 2 and summary["heldout_prompts"] == 8
    assert summary["heldout_accuracy_after_stderr"] is not None and summary["heldout_pass_at_k_after"] >= summary["heldout_accuracy_after"]
    assert sorted(p.name for p in (run / "adapters").iterdir()) == ["v4", "v5"]
    report = (run / "report.html").read_text()
    assert report.count("<div class='chart'>") >= 9 and "Held-out samples" in report  # plotly charts, drawn in the browser test
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]  # run.log_samples: 4 a step
    assert [s["step"] for s in samples] == [step for step in range(1, 6) for _ in range(4)]
    assert {"step", "prompt", "completion", "reward", "group"} <= samples[0].keys()
    roles = json.loads((run / "processes.json").read_text())
    assert roles["rollout"]["restarts"] == 1 and roles["reference"]["restarts"] == 1
    for role in ("rollout", "reference"):
        assert not _alive(roles[role]["pid"]), f"{role} server outlived the run"


def test_a_run_over_its_mismatch_bound_stops_off_policy_with_its_checkpoint(tmp_path, int4_dir):
    """algorithm.max_mismatch below what fp16 vs fp32 arithmetic gives: after max_mismatch_steps
    steps over it the run stops with reason OffPolicy, its last step checkpointed."""
    config = _job(tmp_path, int4_dir, algorithm={"max_mismatch": 1e-9, "max_mismatch_steps": 2},
                  schedule={"steps": 6, "learning_rate": 1e-3}, checkpoint={"every_steps": 10})  # fmt: skip
    run = tmp_path / "runs" / "t"
    proc = _orbit("train", str(config), cwd=tmp_path)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2, output[-3000:]  # the CLI's exit code for an error it explains
    assert "exceeded algorithm.max_mismatch (1e-09) for 2 consecutive steps" in output, output[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "OffPolicy" and summary["steps"] == 2 and summary["on_policy"]["state"] == "exceeded"
    assert [s["off_policy_steps"] for s in _steps(run)] == [1, 2]
    assert summary["last_checkpoint_step"] == 2
    listed = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "checkpoints", "list", f"file://{run / 'checkpoints'}",
                             "--json"], capture_output=True, text=True, check=True)  # fmt: skip
    assert [(c["step"], c["complete"]) for c in json.loads(listed.stdout)] == [(2, True)]  # intact: manifest committed


def test_a_reward_that_mostly_fails_fails_the_run_naming_it(tmp_path, int4_dir):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "fragile_rewards.py").write_text(FRAGILE_REWARD)
    config = _job(tmp_path, int4_dir, rewards=[{"function": "exact_match"}, {"function": "fragile_rewards:always_fails"}])
    proc = _orbit("train", str(config), cwd=tmp_path, env_extra={"PYTHONPATH": str(tmp_path / "plugins")})
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2, output[-3000:]  # the CLI's exit code for an error it explains
    assert "reward fragile_rewards:always_fails (rewards[1]) raised on" in output and "reward backend down" in output


def test_stop_signal_checkpoints_and_stops_cleanly_without_orphans(tmp_path, int4_dir):
    """Ctrl-C. (SIGTERM takes the same handler; the end-to-end job B stops a pod's learner with it.)"""
    stop = signal.SIGINT
    config = _job(tmp_path, int4_dir, schedule={"steps": 50, "learning_rate": 1e-3})
    run = tmp_path / "runs" / "t"
    metrics_port = free_port()
    key = "train-test-key"  # the run's API key (a pod's comes from the job's Secret; unset, orbit train makes one)
    proc = _orbit("train", str(config), "--metrics-port", str(metrics_port), cwd=tmp_path, env_extra={"ORBIT_API_KEY": key})
    try:
        _wait_for(lambda: len(_steps(run)) >= 1, 300, "the first training step")
        roles = json.loads((run / "processes.json").read_text())
        # the learner serves /healthz, /metrics and /status (what the operator copies into a job's status)
        assert roles["learner"]["metrics_url"] == f"http://127.0.0.1:{metrics_port}"
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/healthz").status_code == 200
        assert "orbit_learner_step" in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/status").status_code == 401
        progress = httpx.get(f"http://127.0.0.1:{metrics_port}/status", headers={"Authorization": f"Bearer {key}"}).json()
        assert progress["phase"] == "running" and progress["maxSteps"] == 50 and progress["step"] >= 1
        proc.send_signal(stop)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + stop, output[-2000:]
    assert "stopped at step" in output and stop.name in output
    assert f"metrics: http://127.0.0.1:{metrics_port}/metrics" in output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and 1 <= summary["steps"] < 50
    # the state after the last completed step was checkpointed before exiting (default URI: the run dir)
    assert summary["last_checkpoint_step"] == summary["steps"], summary
    listing = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "checkpoints", "list", summary["checkpoint_uri"], "--json"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    assert [(c["step"], c["complete"]) for c in json.loads(listing.stdout)] == [(summary["steps"], True)]
    _wait_for(lambda: not _alive(roles["rollout"]["pid"]), 30, "the vLLM server to exit")


def test_config_errors_name_the_field(tmp_path, int4_dir):
    config = _job(tmp_path, int4_dir, rollout={"group_size": 1, "max_tokenz": 4})
    result = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "train", str(config)], capture_output=True, text=True)
    assert result.returncode == 2
    assert "rollout.group_size" in result.stderr and "rollout.max_tokenz" in result.stderr
    assert "Traceback" not in result.stderr
