"""MLflow: one MLflow run per Orbit run (the mlflow extra: mlflow-skinny, with SQLAlchemy for a local
store). Parameters are the flattened job spec, metrics the rows of metrics.jsonl, samples JSON tables
in MLflow's table format, the report, job spec and final adapter artifacts.

The store is run.tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else a SQLite store at
<output_dir>/mlflow.db with artifacts under <output_dir>/mlflow-artifacts (MLflow's file store is in
maintenance mode and refuses to start by default).
Credentials come from MLflow's own variables (MLFLOW_TRACKING_TOKEN, ..._USERNAME/_PASSWORD). A
resumed run continues the MLflow run whose id its checkpoint carries (also in <run>/tracking.json); MLflow
cannot delete metric points, so steps the previous life logged after its checkpoint stay, next to the new ones."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from orbit_runtime.tracking.fanout import TrackingContext
from orbit_runtime.tracking.rows import flat_params, sample_table

STATUS = {"succeeded": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
BATCH = 100  # MLflow accepts at most 100 params and 1000 metrics per log_batch


def tracking_uri(context: TrackingContext) -> tuple[str, str | None]:
    """The store's URI and, for the local default store, where its experiments keep artifacts
    (<output_dir>/mlflow-artifacts; MLflow's own default is ./mlruns under whatever the working directory is)."""
    configured = context.run.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if configured:
        return configured, None
    output = context.output_dir.resolve()
    return f"sqlite:///{output / 'mlflow.db'}", (output / "mlflow-artifacts").as_uri()


class MlflowTracker:
    def __init__(self, context: TrackingContext) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri, artifacts = tracking_uri(context)
        self.client = MlflowClient(tracking_uri=uri)
        name = context.run.tracking.experiment
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name, artifact_location=artifacts)
        run_id = context.ids().get("mlflow") if context.resumed_step is not None else None
        self.needs_history = run_id is None or not self._exists(run_id)  # a new MLflow run starts empty
        if self.needs_history:
            run_id = self.client.create_run(experiment_id, run_name=context.run.name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        try:
            if self.needs_history:
                params = [Param(k, v) for k, v in flat_params(context.spec_json).items()]
                for i in range(0, len(params), BATCH):
                    self.client.log_batch(run_id, params=params[i : i + BATCH])
            self.client.log_dict(run_id, context.spec_json, "job.json")
            context.save_id("mlflow", run_id)  # only a run that got its params is one to continue
        except Exception:
            with contextlib.suppress(Exception):  # the first error is the one to report
                self.client.set_terminated(run_id, "FAILED")  # not left RUNNING by a tracker that never opened
            raise

    def _exists(self, run_id: str) -> bool:
        """Whether the store has RUN_ID, not deleted; only MLflow's 'does not exist' means no (a store that is
        down raises)."""
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException as exc:
            if exc.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                return False
            raise

    def log_metrics(self, step: int, metrics: dict[str, float], timestamp: float) -> None:
        from mlflow.entities import Metric

        ms = int(timestamp * 1000) if timestamp else int(time.time() * 1000)
        rows = [Metric(key, value, ms, step) for key, value in metrics.items()]
        for i in range(0, len(rows), 10 * BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i : i + 10 * BATCH])

    def log_samples(self, step: int, table: str, samples: list[dict]) -> None:
        columns, rows = sample_table(samples)  # MLflow's table format (what log_table writes, without pandas)
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"{table}/step-{step:06d}.json")

    def log_artifact(self, path: Path) -> None:
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), path.name)
        elif path.exists():
            self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, STATUS.get(status, "FAILED"))
