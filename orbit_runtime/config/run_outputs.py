"""What a run writes and where: its directory and samples (`run`), its Prometheus endpoint
(`metrics`), and the experiment trackers its metrics also go to.

`run.report_to` names the trackers (none by default), as TRL's `report_to` and verl's
`trainer.logger` do; `run.tracking` says where each one writes. Credentials never go here: MLflow
reads MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN and W&B reads WANDB_API_KEY from the
environment (in a cluster, from the Secret `run.trackingSecret` names).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Tracker = Literal["tensorboard", "mlflow", "wandb"]


class TrackingSpec(BaseModel):
    """Where the trackers of `run.report_to` write."""

    model_config = ConfigDict(extra="forbid")

    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server or store (http(s)://..., sqlite:///...). Default: $MLFLOW_TRACKING_URI, "
        "else a SQLite store at <output_dir>/mlflow.db shared by the runs of that directory.",
    )
    experiment: str = Field("orbit", min_length=1, description="MLflow experiment name (created if missing).")
    wandb_project: str = Field("orbit", min_length=1, description="W&B project.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); default: the API key's.")
    wandb_mode: Literal["online", "offline"] | None = Field(
        None,
        description="W&B mode. Default: $WANDB_MODE, else online when WANDB_API_KEY is set and offline otherwise "
        "(files under <run>/wandb, uploaded later with `wandb sync`).",
    )


class MetricsSpec(BaseModel):
    """The learner's Prometheus endpoint (/metrics and /healthz)."""

    model_config = ConfigDict(extra="forbid")

    port: int | None = Field(None, ge=0, le=65535, description="Serve metrics on this port (0: any free port; null: off).")
    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 in a pod so Prometheus can scrape it.")


class RunSpec(BaseModel):
    """The run's name and files, and the trackers its metrics are reported to."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("orbit", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Run name (DNS label).")
    output_dir: str = Field("runs", description="Runs are written to <output_dir>/<name>/.")
    log_samples: int = Field(
        4, ge=0, description="Rollout samples per step written to <output_dir>/<name>/samples.jsonl (0: none; "
        ">= the batch: all)."
    )
    report_to: list[Tracker] = Field(
        default_factory=list,
        description="Experiment trackers the run's metrics, samples, report and final adapter also go to (any of "
        "tensorboard, mlflow, wandb; each needs its optional extra installed). A failing tracker never stops training.",
    )
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description=TrackingSpec.__doc__)

    @field_validator("report_to")
    @classmethod
    def validate_report_to(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) != len(trackers):
            raise ValueError(f"names a tracker twice: {trackers}")
        return trackers
