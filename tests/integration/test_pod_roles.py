"""The pod's role commands as separate processes, as the pod's containers run them: `orbit
rollout` (real vLLM), `orbit reference` and `orbit learner` talking over loopback, adapters
through a shared directory. The rollout is killed mid-run and started again (the kubelet's
job for a sidecar): the learner waits, re-syncs its adapter, and finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from orbit_runtime.processes import free_port
from tests.integration.test_train import _job, _steps, _wait_for

pytestmark = pytest.mark.vllm


def _role(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orbit_runtime.cli", *args], env={**os.environ},
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def test_rollout_reference_and_learner_as_separate_processes_survive_a_rollout_restart(tmp_path, int4_dir):
    config = _job(tmp_path, int4_dir, reference={"mode": "server"}, schedule={"steps": 4, "learning_rate": 1e-3},
                  checkpoint={"every_steps": 1, "uri": f"file://{tmp_path / 'ckpt'}"})  # fmt: skip
    rollout_port, reference_port = free_port(), free_port()
    rollout_url, reference_url = f"http://127.0.0.1:{rollout_port}", f"http://127.0.0.1:{reference_port}"
    adapters = tmp_path / "adapters"  # the pod's emptyDir
    adapters.mkdir()
    roles = {
        "rollout": ["rollout", str(config), "--host", "127.0.0.1", "--port", str(rollout_port)],
        "reference": ["reference", str(config), "--host", "127.0.0.1", "--port", str(reference_port)],
    }
    procs = {name: _role(*args, log=tmp_path / f"{name}.log") for name, args in roles.items()}
    learner = subprocess.Popen(
        [sys.executable, "-m", "orbit_runtime.cli", "learner", str(config), "--wait-seconds", "300"],
        env={**os.environ, "ORBIT_ROLLOUT_URL": rollout_url, "ORBIT_REFERENCE_URL": reference_url, "ORBIT_ADAPTERS_DIR": str(adapters)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    run = tmp_path / "runs" / "t"
    try:
        _wait_for(lambda: len(_steps(run)) >= 2, 600, "two steps")
        assert sorted(p.name for p in adapters.iterdir())  # versions published where the rollout reads them
        os.killpg(procs["rollout"].pid, signal.SIGKILL)  # the rollout container dies ...
        procs["rollout"].wait()
        procs["rollout"] = _role(*roles["rollout"], log=tmp_path / "rollout.log")  # ... and the kubelet restarts it
        output, _ = learner.communicate(timeout=900)
        assert learner.returncode == 0, output[-4000:]
        summary = json.loads(output.strip().splitlines()[-1])
        assert summary["steps"] == 4
        steps = _steps(run)
        assert [s["step"] for s in steps] == [1, 2, 3, 4]
        assert steps[-1]["rollout_restarts"] == 1  # waited for it, re-synced, went on
        assert httpx.get(f"{reference_url}/healthz").status_code == 200
    finally:
        if learner.poll() is None:
            learner.kill()
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


def test_the_learner_says_in_one_line_when_a_role_never_answers(tmp_path, int4_dir):
    config = _job(tmp_path, int4_dir)
    result = subprocess.run(
        [sys.executable, "-m", "orbit_runtime.cli", "learner", str(config), "--wait-seconds", "3",
         "--rollout-url", f"http://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "rollout at http://127.0.0.1:" in result.stderr and "did not answer its health check within 3s" in result.stderr
    assert "Traceback" not in result.stderr
