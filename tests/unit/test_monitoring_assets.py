"""The alert rules pass promtool's checks and unit tests (each alert fires from synthetic
series), and the Grafana dashboard is well-formed. The live evaluation of every query
against a real Prometheus scraping a live pod is in tests/e2e/test_rljob.py (job B)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "orbit"
RULES = CHART / "rules" / "orbit-rules.yaml"
RULE_TESTS = CHART / "rules" / "orbit-rules.test.yaml"
DASHBOARD = CHART / "dashboards" / "orbit.json"


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool (Debian's prometheus package) is required: `make test` installs it"
    return path


def test_promtool_checks_and_unit_tests_pass():
    check = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run([_promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, cwd=RULES.parent)
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_every_alert_has_a_firing_unit_test_severity_and_runbook():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert set(alerts) >= {"OrbitTrainerStuck", "OrbitMismatchHigh", "OrbitAdapterSyncFailing", "OrbitCheckpointStale", "OrbitRolloutDown"}
    fired = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == set(alerts), f"alerts without a firing test: {set(alerts) - fired}"
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert len(rule["annotations"].get("runbook", "")) > 80, f"{name}: runbook text missing"
        assert "job" not in rule["expr"], f"{name}: no `job` label in Orbit's rules"


def test_dashboard_uses_the_datasource_variable_everywhere():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    titles = [p["title"] for p in dashboard["panels"]]
    assert len(titles) == len(set(titles))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"].strip(), panel["title"]
    wanted = ["reward", "mismatch", "kl", "throughput", "step time", "lag", "sync latency", "checkpoint", "memory"]
    text = " ".join(t.lower() for t in titles)
    assert all(word in text for word in wanted), [w for w in wanted if w not in text]
