"""A real Prometheus (Debian's package) for the tests, and the checks every Orbit dashboard
panel and alert rule must pass against a live run's metrics.

Grafana itself is not packaged here; its panels are exactly these queries (with Grafana's
`$__rate_interval`/`$__range` filled in), evaluated through Prometheus's HTTP API.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from orbit_runtime.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
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
        deadline = time.monotonic() + 60
        while not self._ready():
            assert time.monotonic() < deadline, "Prometheus did not become ready in 60 s"
            time.sleep(0.5)

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


# Queries only some jobs feed: (title, PromQL) -> what feeds it. A job without that feature
# leaves them empty; their queries must still evaluate. (The panel's mismatch-without-replay
# gauge is unlabelled, so prometheus_client exports it, at 0, from the start.)
ROUTING_REPLAY_ONLY = {
    ("MoE routing (routing replay)", "orbit_learner_routing_agreement"): "moe.routing_replay",
}


def assert_dashboards_and_rules_have_data(prometheus: Prometheus, routing_replay: bool = False) -> None:
    """Every dashboard query returns data (those of features the job does not use evaluate, empty);
    every rule loads healthy and reads series that exist; no alert fires or is pending (the run is
    healthy); the learner's view of the rollout is live."""
    expected_empty = set() if routing_replay else set(ROUTING_REPLAY_ONLY)
    empty = {(title, expr) for title, expr in dashboard_queries() if not prometheus.has_data(expr)}
    assert empty == expected_empty, f"dashboard panels without data: {sorted(empty - expected_empty)}; " \
        f"with data a job like this cannot feed: {sorted(expected_empty - empty)}"  # fmt: skip

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
    active = [a for a in prometheus.api.get("/api/v1/alerts").json()["data"]["alerts"] if a["state"] in ("firing", "pending")]
    assert not active, active  # quiet means neither firing nor about to
    assert float(prometheus.query("orbit_rollout_up")["result"][0]["value"][1]) == 1
    lag = prometheus.query("orbit_learner_adapter_version - orbit_sync_rollout_adapter_version")["result"]
    assert float(lag[0]["value"][1]) in (0.0, 1.0)  # 1 only while a sync is in flight
