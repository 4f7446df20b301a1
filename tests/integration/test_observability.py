"""A real Prometheus (Debian's package) scrapes a live `orbit train` run: every PromQL
expression of the Grafana dashboard and of the alert rules is evaluated through its HTTP API
and must return data. Grafana itself is not packaged here; its panels are exactly these
queries (with Grafana's `$__rate_interval`/`$__range` filled in)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from orbit_runtime.processes import free_port
from tests.integration.test_checkpoint_resume import SHARE_OF_B
from tests.integration.test_checkpoint_resume import _orbit as run_orbit
from tests.integration.test_train import _steps, _wait_for

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "orbit" / "dashboards" / "orbit.json"
RULES = ROOT / "charts" / "orbit" / "rules" / "orbit-rules.yaml"
GRAFANA_MACROS = {"$__rate_interval": "20s", "$__range": "2m"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, Grafana macros filled in."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for macro, value in GRAFANA_MACROS.items():
                expr = expr.replace(macro, value)
            out.append((panel["title"], expr))
    return out


def rule_names_in(expr: str) -> set[str]:
    """Series names an expression reads (metric and recording-rule names; not functions)."""
    return {m for m in re.findall(r"\b(orbit[:_][a-z0-9_:]+)", expr)}


class Prometheus:
    def __init__(self, tmp: Path, targets: dict[str, str]) -> None:
        binary = shutil.which("prometheus")
        assert binary, "Debian's prometheus is required: `make test` installs it (apt-get install prometheus)"
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": f"orbit-{role}", "static_configs": [{"targets": [target], "labels": {"orbit_role": role}}]}
                for role, target in targets.items()
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)
        _wait_for(self._ready, 60, "Prometheus to be ready")

    def _ready(self) -> bool:
        try:
            return self.api.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> dict:
        body = self.api.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]

    def has_data(self, expr: str) -> bool:
        return len(self.query(expr)["result"]) > 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def test_every_dashboard_and_alert_expression_returns_data(tmp_path, int4_dir):
    (tmp_path / "orbit_test_rewards.py").write_text(SHARE_OF_B)
    job = {
        "model": {"path": str(int4_dir), "dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16},
        "algorithm": {"kl_beta": 0.02},
        "data": {"type": "synthetic_arithmetic", "max_value": 9, "validation_size": 4},
        "rewards": [{"function": "orbit_test_rewards:share_of_b"}],
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 6},
        "reference": {"mode": "server"},
        "schedule": {"steps": 200, "learning_rate": 1e-3},
        "eval": {"every_steps": 2},
        "checkpoint": {"every_steps": 1, "keep_last": 2},
        "run": {"name": "observed", "output_dir": str(tmp_path / "runs")},
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    run = tmp_path / "runs" / "observed"
    metrics_port = free_port()
    proc = run_orbit("train", str(config), "--metrics-port", str(metrics_port), env={})
    prometheus = None
    try:
        roles = _wait_for(lambda: (run / "processes.json").exists() and json.loads((run / "processes.json").read_text()), 300,
                          "the roles to start")  # fmt: skip
        assert roles["learner"]["metrics_url"] == f"http://127.0.0.1:{metrics_port}"
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/healthz").status_code == 200
        reference = httpx.get(f"{roles['reference']['url']}/healthz")
        assert reference.status_code == 200
        targets = {
            "learner": f"127.0.0.1:{metrics_port}",
            "rollout": roles["rollout"]["url"].removeprefix("http://"),  # vLLM's own /metrics
            "reference": roles["reference"]["url"].removeprefix("http://"),
        }
        prometheus = Prometheus(tmp_path, targets)
        # enough steps, a landed checkpoint and ~20 s of 1 s scrapes for every rate() window
        _wait_for(lambda: len(_steps(run)) >= 4, 300, "four training steps")
        _wait_for(lambda: prometheus.has_data("count_over_time(orbit_learner_step[1m]) >= 20"), 120, "20 scrapes")
        _wait_for(lambda: prometheus.has_data("orbit_checkpoint_last_step > 0"), 60, "a checkpoint")
        # the learner's /status: what the operator copies into the RLTrainingJob's status
        progress = httpx.get(f"http://127.0.0.1:{metrics_port}/status").json()
        assert progress["phase"] == "running" and progress["maxSteps"] == 200 and progress["step"] >= 4
        assert progress["lastCheckpoint"]["step"] >= 1 and progress["lastCheckpoint"]["uri"].startswith("file://")
        assert isinstance(progress["reward"], float) and isinstance(progress["heldoutAccuracy"], float)
        assert progress["restarts"] == {"rollout": 0, "reference": 0}
        up = {r["metric"]["orbit_role"]: r["value"][1] for r in prometheus.query("up")["result"]}
        assert up == {"learner": "1", "rollout": "1", "reference": "1"}, up

        empty = [(title, expr) for title, expr in dashboard_queries() if not prometheus.has_data(expr)]
        assert not empty, f"dashboard panels without data: {empty}"

        rules = prometheus.api.get("/api/v1/rules").json()["data"]["groups"]
        loaded = [rule for group in rules for rule in group["rules"]]
        file_rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
        assert len(loaded) == len(file_rules)
        assert all(rule["health"] == "ok" for rule in loaded), [(r["name"], r.get("lastError")) for r in loaded]
        for rule in file_rules:
            if "record" in rule:
                assert prometheus.has_data(rule["record"]), f"recording rule {rule['record']} has no data"
            else:
                prometheus.query(rule["expr"])  # valid PromQL (a quiet alert returns no series)
                for name in rule_names_in(rule["expr"]):
                    assert prometheus.has_data(name), f"alert {rule['alert']} reads {name}, which has no data"
        # the run is healthy, so no alert fires
        firing = [a for a in prometheus.api.get("/api/v1/alerts").json()["data"]["alerts"] if a["state"] == "firing"]
        assert not firing, firing
        # the learner's view of the rollout matches the run
        assert float(prometheus.query("orbit_rollout_up")["result"][0]["value"][1]) == 1
        lag = prometheus.query("orbit_learner_adapter_version - orbit_sync_rollout_adapter_version")["result"]
        assert float(lag[0]["value"][1]) in (0.0, 1.0)  # 1 only while a sync is in flight
    finally:
        if prometheus is not None:
            prometheus.stop()
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=180)
        finally:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert f"metrics: http://127.0.0.1:{metrics_port}/metrics" in output
