"""TensorBoard: event files under <run>/tensorboard (torch's SummaryWriter; the tensorboard extra).

A resumed run purges the events after its checkpoint's step, so the curves continue from it; samples
are text (a Markdown table per step), the only table TensorBoard has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from orbit_runtime.tracking.fanout import TrackingContext
from orbit_runtime.tracking.rows import sample_table


class TensorBoardTracker:
    def __init__(self, context: TrackingContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = context.run_dir / "tensorboard"
        fresh = context.resumed_step is None
        if fresh:
            shutil.rmtree(self.log_dir, ignore_errors=True)  # a new run in an old directory: not the old curves
        self.needs_history = fresh or not any(self.log_dir.glob("events.out.tfevents.*"))
        purge = None if fresh else context.resumed_step + 1
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge, flush_secs=30)
        self.writer.add_text("config", f"```json\n{json.dumps(context.spec_json, indent=2)}\n```", 0)

    def log_metrics(self, step: int, metrics: dict[str, float], timestamp: float) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step, walltime=timestamp)

    def log_samples(self, step: int, table: str, samples: list[dict]) -> None:
        columns, rows = sample_table(samples)

        def cell(value) -> str:
            return str(value).replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text(table, "\n".join(lines), step)

    def log_artifact(self, path: Path) -> None:
        """TensorBoard keeps no artifacts: the report and adapter stay in the run directory."""

    def close(self, status: str) -> None:
        self.writer.close()
