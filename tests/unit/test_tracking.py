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
from orbit_runtime.tracking.fanout import QUEUE_SIZE, TrackingContext, check_installed
from orbit_runtime.tracking.rows import flat_params, row_metrics, sample_table


def _context(tmp_path, report_to, resumed_step=None, run_ids=None, **tracking):
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True, exist_ok=True)
    run = RunSpec(name="t", output_dir=str(tmp_path / "runs"), report_to=report_to, tracking=tracking)
    spec = {"rollout": {"group_size": 4, "stop": ["\n"]}, "run": run.model_dump(mode="json")}
    return TrackingContext(run_dir=run_dir, output_dir=run_dir.parent, run=run, spec_json=spec, resumed_step=resumed_step,
                           run_ids={} if run_ids is None else run_ids)  # fmt: skip


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


def test_a_resume_continues_the_tracker_run_its_checkpoint_names_or_starts_one_with_the_curves_so_far(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # a configured store's new experiment keeps artifacts in ./mlruns (MLflow's default)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    ids: dict = {}  # what the run's checkpoints carry (RunState.tracker_runs)
    first = open_trackers(_context(tmp_path, ["mlflow"], run_ids=ids), [])
    first.log_row(_step(1, 0.1))
    assert first.finish("stopped", [], timeout_s=120) is None
    run_id = ids["mlflow"]
    # a new pod: its run directory (and tracking.json) is gone, the checkpoint's ids are not
    (tmp_path / "runs" / "t" / "tracking.json").unlink()
    resumed = open_trackers(_context(tmp_path, ["mlflow"], resumed_step=1, run_ids=dict(ids)), [_step(1, 0.1)])
    resumed.log_row(_step(2, 0.2))
    assert resumed.finish("succeeded", [], timeout_s=120) is None
    assert [m.step for m in client.get_metric_history(run_id, "step/reward_mean")] == [1, 2]  # one MLflow run
    # the checkpoint names a run the store does not have (a new store): a new run, given the curves so far
    other = f"sqlite:///{tmp_path / 'other.db'}"
    client = MlflowClient(tracking_uri=other)
    again = _context(tmp_path, ["mlflow"], resumed_step=2, run_ids={"mlflow": run_id}, mlflow_tracking_uri=other)
    fanout = open_trackers(again, [_step(1, 0.1), _step(2, 0.2)])
    fanout.log_row(_step(3, 0.3))
    assert fanout.finish("succeeded", [], timeout_s=120) is None
    assert again.run_ids["mlflow"] != run_id
    assert [(m.step, m.value) for m in client.get_metric_history(again.run_ids["mlflow"], "step/reward_mean")] == [
        (1, 0.1), (2, 0.2), (3, 0.3)]  # fmt: skip


def test_wandb_keeps_rows_that_arrive_after_a_later_step(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    fanout = open_trackers(_context(tmp_path, ["wandb"]), [])
    fanout.log_row(_step(3, 0.3))
    fanout.log_row({"kind": "checkpoint", "step": 2, "seconds": 1.5})  # a checkpoint's row lands after step 3
    assert fanout.finish("succeeded", [], timeout_s=120) is None
    logs = "".join(p.read_text() for p in (tmp_path / "runs" / "t" / "wandb").glob("offline-run-*/logs/debug-internal.log"))
    assert logs and "ignoring partial history record" not in logs  # W&B's own word that it dropped a row


def test_a_hanging_tracker_costs_the_end_of_the_run_its_timeout_and_no_more(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")
    silent = socket.socket()  # a tracking server that accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        fanout = open_trackers(_context(tmp_path, ["mlflow"], mlflow_tracking_uri=f"http://127.0.0.1:{silent.getsockname()[1]}"), [])
        for step in range(QUEUE_SIZE + 10):  # the queue fills up behind the hung tracker; the rest is dropped
            fanout.log_row(_step(step + 1, 0.0))
        started = time.monotonic()
        warning = fanout.finish("succeeded", [tmp_path], timeout_s=1.0)
        assert time.monotonic() - started < 2.0  # the whole end (queueing the artifact and close included)
        assert warning and "did not finish within 1s" in warning
    finally:
        silent.close()


def test_what_leaves_the_run_directory_has_its_credentials_masked_and_a_failed_adapter_still_closes_the_trackers(
    tmp_path, monkeypatch
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from orbit_runtime.config.spec import JobSpec
    from orbit_runtime.redaction import REDACT_ENV
    from orbit_runtime.run_paths import RunPaths
    from orbit_runtime.trainer.recorder import RunRecorder, RunState

    monkeypatch.setenv(REDACT_ENV, "CALC_TOKEN")
    monkeypatch.setenv("CALC_TOKEN", "tok-0123456789")
    spec = JobSpec.model_validate({
        "model": {"path": str(tmp_path / "base")},
        "run": {"name": "t", "output_dir": str(tmp_path / "runs"), "report_to": ["tensorboard"],
                "tracking": {"mlflow_tracking_uri": "https://alice:hunter2-secret@mlflow.example"}},
    })  # fmt: skip
    paths = RunPaths(tmp_path / "runs" / "t").create()
    recorder = RunRecorder(paths, RunState(), "t", spec)
    shared = json.dumps(recorder.shareable_spec())
    assert "hunter2-secret" not in shared and "https://***@mlflow.example" in shared
    monkeypatch.setattr(spec.run.tracking, "experiment", "tok-0123456789")  # a secret value wherever it appears
    assert "tok-0123456789" not in json.dumps(recorder.shareable_spec())

    recorder.open_trackers(None)
    recorder.record({"kind": "step", "step": 1, "reward_mean": 0.5})
    recorder.write_summary({"steps": 1})
    assert "hunter2-secret" not in paths.report.read_text()

    def full_disk(_dir):
        raise OSError(28, "No space left on device")

    assert recorder.finish_trackers("succeeded", full_disk, deadline=time.monotonic() + 60) is None  # closed all the same
    events = EventAccumulator(str(paths.root / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("step/reward_mean")] == [1]
    assert "hunter2-secret" not in json.dumps([t.tensor_proto.string_val[0].decode() for t in events.Tensors("config/text_summary")])
