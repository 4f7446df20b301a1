"""The Helm chart renders the dashboard ConfigMap and the PrometheusRule from the very files
promtool and the Prometheus test check (rendered offline with Helm's Go SDK, no cluster)."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "orbit"


def _render(values: dict | None = None) -> dict[str, dict]:
    manifests = helm.Chart.load(CHART).render(values, name="orbit", namespace="ml")
    documents = {path: [d for d in yaml.safe_load_all(text) if d] for path, text in manifests.items() if not path.endswith("NOTES.txt")}
    return {path: docs[0] for path, docs in documents.items() if len(docs) == 1}  # the single-object templates


def test_chart_lints_clean():
    report = helm.lint(CHART, strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report


def test_dashboard_configmap_for_the_grafana_sidecar():
    rendered = _render()
    configmap = rendered["orbit/templates/grafana-dashboard.yaml"]
    assert configmap["kind"] == "ConfigMap" and configmap["metadata"]["namespace"] == "ml"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["orbit.json"]) == json.loads((CHART / "dashboards" / "orbit.json").read_text())
    assert "orbit/templates/prometheusrule.yaml" not in rendered  # needs the Prometheus Operator CRD: opt-in


def test_prometheus_rule_wraps_the_rule_file():
    rendered = _render({"monitoring": {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                                       "grafanaDashboard": {"enabled": False}}})  # fmt: skip
    rule = rendered["orbit/templates/prometheusrule.yaml"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load((CHART / "rules" / "orbit-rules.yaml").read_text())
    assert "orbit/templates/grafana-dashboard.yaml" not in rendered
