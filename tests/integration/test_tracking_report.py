"""A short real run (`orbit train`: learner, vLLM, reference) with run.report_to [tensorboard, mlflow,
wandb]: each tracker's own reader finds the run's step metrics as metrics.jsonl has them, W&B's
offline run files exist, and report.html, opened in a real headless Chromium (Debian's, driven by
Playwright without its browser download; no network), draws every chart without a console error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.orbit_train import train_job

pytestmark = pytest.mark.vllm
CHROMIUM = "/usr/bin/chromium"  # Debian's chromium package, installed by `make test-tools`
ARTIFACTS = Path(os.environ.get("ORBIT_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, int4_dir) -> Path:
    tmp_path = tmp_path_factory.mktemp("tracked")
    job = {
        "model": {"path": str(int4_dir), "dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16},
        "data": {"type": "synthetic_arithmetic", "max_value": 9, "validation_size": 4},
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_tokens": 6},
        "schedule": {"steps": 3, "learning_rate": 1e-3},
        "eval": {"every_steps": 2},
        "run": {"name": "tracked", "output_dir": str(tmp_path / "runs"), "report_to": ["tensorboard", "mlflow", "wandb"]},
    }
    with pytest.MonkeyPatch.context() as env:  # for `orbit train` only: the suite's environment is given back
        env.delenv("WANDB_API_KEY", raising=False)
        env.setenv("WANDB_MODE", "offline")  # W&B writes its run files and uploads nothing
        return train_job(tmp_path, job)


def _step_metrics(run: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's step rows as {"step/<field>": [(step, value)]}, the names the trackers use."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        if row["kind"] == "step":
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "time"):
                    out.setdefault(f"step/{key}", []).append((row["step"], float(value)))
    return out


def test_tensorboard_and_mlflow_hold_the_step_metrics_of_metrics_jsonl(tracked_run):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = _step_metrics(tracked_run)
    assert [s for s, _ in expected["step/reward_mean"]] == [1, 2, 3] and "step/mismatch_mean_abs" in expected
    events = EventAccumulator(str(tracked_run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-30), key  # float32 there
    client = MlflowClient(tracking_uri=f"sqlite:///{tracked_run.parent / 'mlflow.db'}")
    run_id = json.loads((tracked_run / "tracking.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["rollout.group_size"] == "4" and run.data.params["schedule.steps"] == "3"
    for key, points in expected.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, key)] == points, key
    assert client.get_metric_history(run_id, "eval/accuracy")  # the evaluations too
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"report.html", "summary.json", "job.json", "adapter", "samples", "eval_samples"} <= top, top
    assert "adapter/adapter_model.safetensors" in {a.path for a in client.list_artifacts(run_id, "adapter")}


def test_wandb_offline_writes_its_run_files(tracked_run):
    run_id = json.loads((tracked_run / "tracking.json").read_text())["wandb"]
    runs = list((tracked_run / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1, list((tracked_run / "wandb").iterdir())
    assert (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0  # the history, config and files, for `wandb sync`


def test_the_report_draws_every_chart_in_a_real_browser(tracked_run):
    from playwright.sync_api import sync_playwright

    report = tracked_run / "report.html"
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        requests: list[str] = []
        page.route("**/*", lambda route: (requests.append(route.request.url), route.continue_() if route.request.url.startswith("file:") else route.abort()))
        page.goto(report.as_uri())
        charts = page.locator("#charts .chart").count()
        page.wait_for_function(f"document.querySelectorAll('#charts .js-plotly-plot .main-svg').length >= {charts}", timeout=30_000)
        titles = page.locator(".gtitle").all_text_contents()  # SVG text: no innerText
        traces = page.locator("#charts .js-plotly-plot .scatterlayer .trace, #charts .js-plotly-plot .barlayer .trace").count()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        samples = page.locator("#heldout-samples tr").count()
        browser.close()
    assert errors == []
    assert all(url.startswith("file:") for url in requests), requests  # self-contained: nothing fetched
    assert charts >= 9 and traces >= charts, (charts, traces)
    for title in ("Training reward", "Held-out accuracy", "Train-rollout mismatch", "Importance weights", "KL to the reference",
                  "Adapter sync latency", "Step time by phase", "Memory"):  # fmt: skip
        assert any(t.startswith(title) for t in titles), (title, titles)
    assert samples > 1  # the held-out completions, per evaluation
    assert (ARTIFACTS / "report.png").stat().st_size > 10_000
