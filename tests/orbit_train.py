"""Run `orbit train` on a job dict as a user would: the YAML file, the CLI in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def train_job(tmp_path: Path, job: dict, timeout_s: float = 900) -> Path:
    """Write JOB to TMP_PATH/job.yaml, run `orbit train` on it (it must succeed) and return the run's directory."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    run = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "train", str(config)],
                         capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return Path(job["run"]["output_dir"]) / job["run"]["name"]
