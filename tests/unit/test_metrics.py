"""The metric definitions follow Prometheus conventions, and the endpoint serves them."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from orbit_runtime.observability import metrics
from orbit_runtime.observability.server import MetricsServer
from tests.prometheus import ROUTING_REPLAY_ONLY, rule_names_in

UNITS = ("_seconds", "_bytes", "_total", "_info")


def _families(registry):
    from prometheus_client import generate_latest

    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_names_units_and_labels_follow_conventions():
    for role, registry in metrics.REGISTRIES.items():
        metrics.register_resources(role)
        families = _families(registry)
        assert families, role
        for name, family in families.items():
            assert name.startswith("orbit_"), name
            if family.type == "counter":  # the exposition adds _total to counters
                assert not name.endswith("_total"), name
            for sample in family.samples:
                assert "job" not in sample.labels, sample
                if family.type in ("counter",):
                    assert sample.name.endswith("_total"), sample.name
            if "seconds" in name or "bytes" in name:
                assert name.endswith(UNITS), f"{name}: the unit goes last"
    learner = _families(metrics.LEARNER_REGISTRY)
    assert not any(name.startswith("orbit_reference_") for name in learner)  # roles export only their own series
    assert {"orbit_learner_step", "orbit_checkpoint_failures", "orbit_sync_canary_failures", "orbit_rollout_up",
            "orbit_process_resident_memory_bytes"} <= set(learner)  # fmt: skip


def _step_record(step: int) -> dict:
    return {
        "time": 1000.0 + step, "step": step, "step_seconds": 2.5, "generate_s": 1.0, "train_s": 1.2, "sync_s": 0.2,
        "samples": 16, "tokens": 96, "reward_mean": 0.25, "reward_std": 0.4, "reward_errors": 1, "kl": 0.01,
        "mismatch_mean_abs": 0.002, "mismatch_max_abs": 0.03, "mismatch_k3_kl": 1e-5, "clip_fraction": 0.1,
        "is_weight_mean": 0.99, "is_over_cap_fraction": 0.02, "loss": -0.1, "grad_norm": 0.7, "learning_rate": 1e-4, "adapter_version": step,
        "adapter_bytes": 1000, "sync_seconds": 0.2, "canary_mean_abs_dlogp": 1e-4,
        "canary_decode_mean_abs_dlogp": 2e-3, "sync_decode_canary_s": 0.15, "sync_canary_expected_s": None,
    }  # fmt: skip


def test_observe_step_and_checkpoint_reach_the_exposition():
    before = _families(metrics.LEARNER_REGISTRY)

    def sample(families, name, suffix="", **labels):
        for s in families[name].samples:
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        raise KeyError(name)

    # counters and histograms carry what earlier tests in this process added: compare deltas
    counted = {key: sample(before, *key) for key in [("orbit_learner_samples", "_total"), ("orbit_learner_reward", "_count"),
                                                      ("orbit_checkpoint_failures", "_total"), ("orbit_sync_bytes", "_total")]}  # fmt: skip
    metrics.observe_step(_step_record(7), [0.0, 0.5, 1.0])
    metrics.observe_checkpoint({"time": 1234.0, "step": 7, "ok": True, "seconds": 0.3, "bytes": 4096})
    metrics.observe_checkpoint({"time": 1240.0, "step": 8, "ok": False, "seconds": 5.0, "error": "x"})
    after = _families(metrics.LEARNER_REGISTRY)

    def value(name, suffix="", **labels):
        return sample(after, name, suffix, **labels)

    def delta(name, suffix):
        return value(name, suffix) - counted[(name, suffix)]

    assert value("orbit_learner_step") == 7
    assert value("orbit_learner_last_step_timestamp_seconds") == 1007.0
    assert delta("orbit_learner_samples", "_total") == 16 and delta("orbit_sync_bytes", "_total") == 1000
    assert value("orbit_learner_phase_seconds", phase="train") == 1.2
    assert value("orbit_learner_phase_seconds", phase="sync_decode_canary") == 0.15  # a part of sync, by its own label
    assert delta("orbit_learner_reward", "_count") == 3
    assert value("orbit_sync_canary_mean_abs_logprob", path="prefill") == 1e-4
    assert value("orbit_sync_canary_mean_abs_logprob", path="decode") == 2e-3
    assert value("orbit_learner_mismatch_mean_abs_logprob") == 0.002
    assert value("orbit_learner_mismatch_over_cap_fraction") == 0.02
    assert value("orbit_checkpoint_last_step") == 7 and value("orbit_checkpoint_size_bytes") == 4096
    assert value("orbit_checkpoint_last_success_timestamp_seconds") == 1234.0
    assert delta("orbit_checkpoint_failures", "_total") == 1


def test_endpoint_serves_metrics_and_health():
    healthy = {"ok": True}
    server = MetricsServer(metrics.LEARNER_REGISTRY, "127.0.0.1", 0, healthy=lambda: healthy["ok"]).start()
    try:
        response = httpx.get(f"{server.url}/metrics")
        assert response.status_code == 200 and "orbit_learner_step" in response.text
        assert response.headers["content-type"].startswith("text/plain")
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        healthy["ok"] = False
        assert httpx.get(f"{server.url}/healthz").status_code == 503
        assert httpx.get(f"{server.url}/nope").status_code == 404
    finally:
        server.stop()


def test_routing_replay_figures_reach_the_exposition():
    record = {**_step_record(9), "routing_agreement": 0.995, "routing_agreement_by_layer": {"1": 0.99, "3": 1.0},
              "mismatch_unreplayed_mean_abs": 4e-4, "routing_missing_samples": 2}  # fmt: skip
    before = _families(metrics.LEARNER_REGISTRY)
    missing_before = sum(s.value for s in before["orbit_learner_routing_missing_samples"].samples if s.name.endswith("_total"))
    metrics.observe_step(record, [0.0])
    after = _families(metrics.LEARNER_REGISTRY)
    agreement = {s.labels["layer"]: s.value for s in after["orbit_learner_routing_agreement"].samples}
    assert agreement == {"all": 0.995, "1": 0.99, "3": 1.0}
    unreplayed = after["orbit_learner_mismatch_unreplayed_mean_abs_logprob"].samples[0].value
    missing = sum(s.value for s in after["orbit_learner_routing_missing_samples"].samples if s.name.endswith("_total"))
    assert unreplayed == 4e-4 and missing - missing_before == 2
    # the dashboard's routing-replay queries (which the dense end-to-end job leaves empty) read these series
    for _, expr in [*ROUTING_REPLAY_ONLY, ("", "orbit_learner_mismatch_unreplayed_mean_abs_logprob")]:
        assert rule_names_in(expr) <= set(after), expr
