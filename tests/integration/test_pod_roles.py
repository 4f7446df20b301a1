"""`orbit learner` as a pod's main container runs it, when a role never comes up. (The roles
running together in the operator's pod, with the rollout killed and restarted mid-run, are
tested end to end in tests/e2e/test_rljob.py.)"""

from __future__ import annotations

import subprocess
import sys

from orbit_runtime.processes import free_port
from tests.integration.test_train import _job


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
