"""Experiment trackers: a run's metrics, samples, report and final adapter sent to TensorBoard,
MLflow or Weights & Biases (`run.report_to`), besides metrics.jsonl and Prometheus.

rows.py turns metrics.jsonl rows into what a tracker logs (pure); fanout.py runs the trackers on a
thread of their own so a slow or failing one never holds up or stops a step; one module per
tracker (tensorboard_tracker, mlflow_tracker, wandb_tracker) speaks its library. Each library is an
optional extra (`pip install 'orbit[tensorboard]'`, `[mlflow]`, `[wandb]`); a run that names one
that is not installed stops before it starts, naming run.report_to.
"""

from orbit_runtime.tracking.fanout import TrackerFanout, open_trackers

__all__ = ["TrackerFanout", "open_trackers"]
