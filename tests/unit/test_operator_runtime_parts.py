"""The operator's runtime parts without a cluster: which API errors are retried
(api_errors.classify) and the requeue scheduler (one reconcile at a time per job, the earliest
due wins, a crashed reconcile tried again)."""

import threading
import time

from kubernetes.client.exceptions import ApiException

from orbit_operator import requeue
from orbit_operator.api_errors import classify
from orbit_operator.requeue import RequeueScheduler


def _error(status, body="", headers=None):
    exc = ApiException(status=status, reason="Reason")
    exc.body, exc.headers = body, headers or {}
    return exc


def test_transient_and_permanent_api_errors():
    assert classify(_error(429), default_delay=3).transient and classify(_error(429), default_delay=3).retry_after == 3
    assert classify(_error(429, headers={"Retry-After": "7"})).retry_after == 7
    assert classify(_error(403, 'pods "x" is forbidden: exceeded quota: compute')).transient
    assert not classify(_error(403, 'pods "x" is forbidden: violates PodSecurity "restricted:latest"')).transient
    assert classify(_error(500)).transient and classify(_error(503)).transient and classify(_error(None)).transient
    assert not classify(_error(422, "spec.tolerations: Unsupported value")).transient and not classify(_error(400)).transient
    assert "422 Reason: spec.tolerations" in classify(_error(422, "spec.tolerations: Unsupported value")).summary


def test_the_scheduler_runs_one_reconcile_per_job_at_a_time_and_the_earliest_due_wins():
    running, overlaps, runs = set(), [], []
    lock = threading.Lock()

    def run(namespace, name):
        with lock:
            if name in running:
                overlaps.append(name)
            running.add(name)
            runs.append(name)
        time.sleep(0.2)
        with lock:
            running.discard(name)

    scheduler = RequeueScheduler(run, workers=4)
    scheduler.start()
    try:
        scheduler.schedule("ns", "a", 10.0)
        scheduler.schedule("ns", "a", 0.0)  # sooner wins
        time.sleep(0.05)
        for _ in range(5):  # asked again while it runs: once more right after, never alongside
            scheduler.schedule("ns", "a", 0.0)
            scheduler.schedule("ns", "a", 0.01)
        deadline = time.monotonic() + 5
        while runs.count("a") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert overlaps == [] and 2 <= runs.count("a") <= 3
        scheduler.forget("ns", "a")
    finally:
        scheduler.stop()


def test_a_crashed_reconcile_is_tried_again(monkeypatch):
    monkeypatch.setattr(requeue, "RETRY_AFTER_CRASH_SECONDS", 0.1)
    calls = []

    def run(namespace, name):
        calls.append(name)
        if len(calls) == 1:
            raise RuntimeError("a bug")

    scheduler = RequeueScheduler(run)
    scheduler.start()
    try:
        scheduler.schedule("ns", "b", 0.0)
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls == ["b", "b"]
    finally:
        scheduler.stop()
