"""The experiment trackers with their real libraries (TensorBoard's event files read back with
TensorBoard's reader, MLflow's SQLite store read back with MlflowClient), a tracker whose server is
down (a closed port), and the rows-to-metrics translation."""

from __future__ import annotations

import json
import time

import pytest

from orbit_runtime.config.run_outputs import RunSpec
from orbit_runtime.errors import OrbitError
from orbit_runtime.observability.metrics import LEARNER_REGISTRY
from orbit_runtime.processes import free_port
from orbit_runtime.tracking import open_trackers
from orbit_runtime.tracking.fanout import TrackingContext, check_installed
from orbit_runtime.tracking.rows import flat_params, row_metrics, sample_table


def _context(tmp_path, report_to, resumed_step=None, **tracking):
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True, exist_ok=True)
    run = RunSpec(name="t", output_dir=str(tmp_path / "runs"), report_to=report_to, tracking=tracking)
    spec = {"rollout": {"group_size": 4, "stop": ["\n"]}, "run": run.model_dump(mode="json")}
    return TrackingContext(run_dir=run_dir, output_dir=run_dir.parent, run=run, spec_json=spec, resumed_step=resumed_step)


def _step(step: int, reward: float) -> dict:
    return {"time": 1_700_000_000.0 + step, "kind": "step", "step": step, "reward_mean": reward, "canary_verdict": "verified",
            "prompt_indices": [1, 2], "routing_agreement_by_layer": {"1": 0.5}, "interrupted": False, "kl": None}  # fmt: skip


def test_a_row_becomes_its_finite_scalars_under_its_kind():
    step, metrics = row_metrics({**_step(3, 0.25), "nan": float("nan")})
    assert step == 3 and metrics == {"step/reward_mean": 0.25, "step/routing_agreement_by_layer/1": 0.5}
    assert row_metrics({"kind": "resume", "from": "s3://x"}) is None  # no step: nothing to plot it against
    assert flat_params({"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": {}}) == {"a.b": "1", "a.c": "[1, 2]", "d": "x", "e": "{}"}
    columns, rows = sample_table([{"step": 1, "completion": "4"}, {"step": 1, "messages": [{"role": "user"}]}])
    assert columns == ["step", "completion", "messages"] and rows[1] == [1, None, '[{"role": "user"}]']


def test_tensorboard_curves_continue_from_the_checkpoint_after_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = open_trackers(_context(tmp_path, ["tensorboard"]), [])
    for step in range(1, 5):
        first.log_row(_step(step, 0.1 * step))
    first.log_samples(4, [{"step": 4, "prompt": "What is 2*10?", "completion": "20"}])
    assert first.finish("stopped", [], timeout_s=60) is None
    # resumed from the step-2 checkpoint: steps 3 and 4 are computed again, with other values
    second = open_trackers(_context(tmp_path, ["tensorboard"], resumed_step=2), [_step(1, 0.1), _step(2, 0.2)])
    for step in (3, 4):
        second.log_row(_step(step, 0.9))
    assert second.finish("succeeded", [], timeout_s=60) is None
    events = EventAccumulator(str(tmp_path / "runs" / "t" / "tensorboard"))
    events.Reload()
    rewards = [(e.step, round(e.value, 6)) for e in events.Scalars("step/reward_mean")]
    assert rewards == [(1, 0.1), (2, 0.2), (3, 0.9), (4, 0.9)]  # one history: the first life's 3 and 4 purged
    assert "samples/text_summary" in events.Tags()["tensors"]


def test_mlflow_holds_the_rows_params_samples_and_artifacts_and_a_resume_continues_its_run(tmp_path):
    from mlflow.tracking import MlflowClient

    report = tmp_path / "report.html"
    report.write_text("<html></html>")
    fanout = open_trackers(_context(tmp_path, ["mlflow"]), [])
    for step in (1, 2):
        fanout.log_row(_step(step, 0.5 * step))
    fanout.log_row({"kind": "eval", "step": 2, "accuracy": 0.75, "samples": [{"prompt": "p", "completion": "c", "score": 1.0}]})
    fanout.log_samples(2, [{"step": 2, "prompt": "p", "completion": "c"}])
    assert fanout.finish("stopped", [report], timeout_s=120) is None
    run_id = json.loads((tmp_path / "runs" / "t" / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.run_name == "t" and run.info.status == "KILLED"
    assert run.info.artifact_uri.startswith((tmp_path / "runs" / "mlflow-artifacts").as_uri())  # not ./mlruns wherever we are
    assert run.data.params["rollout.group_size"] == "4" and run.data.params["rollout.stop"] == '["\\n"]'
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "step/reward_mean")] == [(1, 0.5), (2, 1.0)]
    assert client.get_metric_history(run_id, "eval/accuracy")[0].value == 0.75
    artifacts = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "samples")}
    assert {"report.html", "job.json", "samples/step-000002.json"} <= artifacts
    table = json.loads(open(client.download_artifacts(run_id, "samples/step-000002.json", str(tmp_path))).read())
    assert table == {"columns": ["step", "prompt", "completion"], "data": [[2, "p", "c"]]}  # MLflow's table format
    resumed = open_trackers(_context(tmp_path, ["mlflow"], resumed_step=2), [])
    resumed.log_row(_step(3, 2.0))
    assert resumed.finish("succeeded", [], timeout_s=120) is None
    assert json.loads((tmp_path / "runs" / "t" / "tracking.json").read_text())["mlflow"] == run_id  # the same MLflow run
    assert [m.step for m in client.get_metric_history(run_id, "step/reward_mean")] == [1, 2, 3]
    assert client.get_run(run_id).info.status == "FINISHED"


def _errors(tracker: str, operation: str) -> float:
    return LEARNER_REGISTRY.get_sample_value("orbit_tracker_errors_total", {"tracker": tracker, "operation": operation}) or 0.0


def test_a_tracker_whose_server_is_down_costs_the_run_nothing_but_a_warning_and_a_metric(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    before = _errors("mlflow", "open")
    fanout = open_trackers(_context(tmp_path, ["mlflow"], mlflow_tracking_uri=f"http://127.0.0.1:{free_port()}"), [])
    started = time.monotonic()
    for step in range(1, 50):
        fanout.log_row(_step(step, 0.0))  # the training thread never waits for the tracker
    assert time.monotonic() - started < 0.5
    assert fanout.finish("succeeded", [], timeout_s=60) is None
    assert _errors("mlflow", "open") == before + 1 and "mlflow" not in fanout.trackers
    assert "tracker mlflow: open failed" in caplog.text and "training goes on" in caplog.text


def test_a_tracker_that_is_not_installed_stops_the_run_before_it_starts(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))  # not installable away
    with pytest.raises(OrbitError, match=r"run.report_to names wandb.*pip install 'orbit\[wandb\]'"):
        check_installed(["tensorboard", "wandb"])
    check_installed(["tensorboard", "mlflow"])
