"""Every path of a run directory, named in one place: runs/<name>/..."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    root: Path
    adapters_dir: Path | None = None  # where adapter versions are published (the pod's shared volume); default root/adapters

    @property
    def metrics(self) -> Path:  # one JSON object per step / evaluation
        return self.root / "metrics.jsonl"

    @property
    def samples(self) -> Path:  # run.log_samples rollout samples per step, one JSON object each
        return self.root / "samples.jsonl"

    @property
    def job_spec(self) -> Path:  # the job spec the run was started with (for `orbit plan --compare`)
        return self.root / "job.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    @property
    def final_adapter(self) -> Path:  # the adapter at the end of the run, written for the trackers (run.report_to)
        return self.root / "adapter"

    @property
    def adapters(self) -> Path:  # adapters/v<N>, see sync.adapter_sync.adapter_dir
        return self.adapters_dir or self.root / "adapters"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def processes(self) -> Path:  # pids and URLs of the role servers, for operators and tests
        return self.root / "processes.json"

    @property
    def checkpoint_staging(self) -> Path:  # checkpoints are written here, then uploaded
        return self.root / "checkpoint-staging"

    def start_fresh(self, keep_samples: bool = False) -> None:
        """A new run (or life of a run) in an existing directory: drop the previous outputs (not
        its logs; a resumed run keeps samples.jsonl and trims it to its checkpoint)."""
        import shutil

        for path in (self.metrics, *(() if keep_samples else (self.samples,)), self.summary, self.report, self.processes):
            path.unlink(missing_ok=True)
        for old in self.adapters.glob("*"):  # the directory itself may be a mount point
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(self.checkpoint_staging, ignore_errors=True)
        self.adapters.mkdir(parents=True, exist_ok=True)

    def create(self) -> RunPaths:
        for path in (self.root, self.adapters, self.logs):
            path.mkdir(parents=True, exist_ok=True)
        return self
