"""Weights & Biases (the wandb extra): one W&B run per Orbit run, the job spec as its config, the rows
of metrics.jsonl as its history, samples as wandb.Table, the report as a file and the final adapter as
a model artifact.

Online when WANDB_API_KEY is set, else offline (files under <run>/wandb, `wandb sync` uploads them
later), unless run.tracking.wandb_mode or $WANDB_MODE says otherwise. A resumed run continues the W&B
run whose id its checkpoint carries (also in <run>/tracking.json). Every metric is plotted against
`orbit/step`, a metric of Orbit's own, not W&B's internal step: W&B drops rows whose internal step is
below the last it saw, and a checkpoint's row (or a resumed run's steps) can arrive after a later step."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from orbit_runtime.tracking.fanout import TrackingContext
from orbit_runtime.tracking.rows import sample_table

log = logging.getLogger(__name__)


def wandb_mode(configured: str | None) -> str:
    return configured or os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


STEP_METRIC = "orbit/step"


class WandbTracker:
    def __init__(self, context: TrackingContext) -> None:
        import wandb

        self.wandb = wandb
        settings = context.run.tracking
        mode = wandb_mode(settings.wandb_mode)
        if mode == "offline" and not settings.wandb_mode and not os.environ.get("WANDB_MODE"):
            log.warning("wandb: no WANDB_API_KEY, logging offline to %s/wandb (upload later with `wandb sync`)", context.run_dir)
        run_id = context.ids().get("wandb") if context.resumed_step is not None else None
        self.run = wandb.init(project=settings.wandb_project, entity=settings.wandb_entity, name=context.run.name,
                              id=run_id, resume="allow" if run_id else None, dir=str(context.run_dir), mode=mode,
                              config=context.spec_json, settings=wandb.Settings(console="off", silent=True))  # fmt: skip
        context.save_id("wandb", self.run.id)
        self.needs_history = not self.run.resumed  # offline: never resumed, a new local run (with the same id)
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)
        self.name = context.run.name

    def log_metrics(self, step: int, metrics: dict[str, float], timestamp: float) -> None:
        self.run.log({**metrics, STEP_METRIC: step})

    def log_samples(self, step: int, table: str, samples: list[dict]) -> None:
        columns, rows = sample_table(samples)
        self.run.log({table: self.wandb.Table(columns=columns, data=rows), STEP_METRIC: step})

    def log_artifact(self, path: Path) -> None:
        if path.is_dir():
            artifact = self.wandb.Artifact(f"{self.name}-{path.name}", type="model")
            artifact.add_dir(str(path))
            self.run.log_artifact(artifact)
        elif path.exists():
            self.run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "succeeded" else 1)
