"""How the operator reads a job's Secrets to mask them (operator/orbit_operator/job_secrets.py): the cache
follows the job's UID and the Secrets it names, a foreign API key Secret is never taken for the job's, an
unreadable Secret stops what could quote it, and the log filter masks messages and tracebacks, kopf's
per-object records included. The API is an in-memory stand-in with Kube's two read calls (the emulator
runs the same code for real in tests/kube/test_operator_security.py)."""

import base64
import io
import logging

import pytest
from kubernetes.client.exceptions import ApiException

from orbit_operator import job_secrets

NS = "ml"


def _secret(data: dict[str, str], owner_uid: str | None = None) -> dict:
    meta = {"ownerReferences": [{"uid": owner_uid, "controller": True}]} if owner_uid else {}
    return {"metadata": meta, "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


class Secrets:
    """Kube's secret reads over a dict, counting them."""

    def __init__(self, secrets: dict[str, dict], forbidden: tuple[str, ...] = ()) -> None:
        self.secrets, self.forbidden, self.reads = secrets, forbidden, 0

    def secret(self, namespace: str, name: str) -> dict | None:
        self.reads += 1
        if name in self.forbidden:
            raise ApiException(status=403, reason="Forbidden")
        return self.secrets.get(name)


def _job(uid: str, credentials: str = "s3") -> dict:
    return {"metadata": {"namespace": NS, "name": "qwen", "uid": uid}, "spec": {"checkpoint": {"credentialsSecret": credentials}}}


@pytest.fixture(autouse=True)
def _fresh_cache():
    job_secrets.forget(NS, "qwen")
    yield
    job_secrets.forget(NS, "qwen")


def test_values_are_masked_and_reads_are_cached_per_job_uid_and_named_secret():
    api = Secrets({"s3": _secret({"weird.key": "first-credential-1"}), "s3-new": _secret({"k": "second-credential-2"}),
                   "qwen-api-key": _secret({"api-key": "the-job-key-123456"}, owner_uid="uid-1")})  # fmt: skip
    assert job_secrets.redacted(api, _job("uid-1"), {"m": ["x first-credential-1 the-job-key-123456"]}) == {"m": ["x *** ***"]}
    reads = api.reads
    assert job_secrets.api_key(api, _job("uid-1")) == "the-job-key-123456" and api.reads == reads  # cached
    assert job_secrets.redacted(api, _job("uid-1", "s3-new"), "second-credential-2") == "***"  # another Secret named: read
    assert api.reads > reads
    # the same name re-created: a new UID, and the old job's key Secret is not its own
    assert job_secrets.api_key(api, _job("uid-2")) is None


def test_a_secret_that_cannot_be_read_stops_the_write():
    api = Secrets({}, forbidden=("s3",))
    with pytest.raises(job_secrets.SecretsUnreadable, match="cannot read Secret ml/s3 \\(403 Forbidden\\)"):
        job_secrets.redacted(api, _job("uid-1"), "text")


def test_the_log_filter_masks_messages_tracebacks_and_kopfs_object_records():
    api = Secrets({"s3": _secret({"token": "log-secret-value-77"}), "qwen-api-key": _secret({"api-key": "k" * 40}, "uid-1")})
    job_secrets.redacted(api, _job("uid-1"), "")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(job_secrets.RedactingLogFilter())
    logger = logging.getLogger("test-job-secrets")
    logger.addHandler(handler)
    try:
        logger.warning("upload failed with %s", "log-secret-value-77")
        try:
            raise RuntimeError("boto said log-secret-value-77")
        except RuntimeError:
            logger.exception("reconcile failed")
    finally:
        logger.removeHandler(handler)
    bad = logging.LogRecord("x", logging.WARNING, __file__, 1, "bad %d format", ("not a number",), None)
    assert job_secrets.RedactingLogFilter().filter(bad)  # a broken record: logging reports it, the filter never raises
    text = stream.getvalue()
    assert "log-secret-value-77" not in text and text.count("***") >= 2 and "RuntimeError: boto said ***" in text
    kopf_objects = logging.getLogger("kopf.objects")
    posted = []
    kopf_objects.addFilter(job_secrets.RedactingLogFilter())
    kopf_objects.addHandler(collector := logging.Handler())
    collector.emit = lambda record: posted.append(record.getMessage())  # kopf's poster turns these into Events
    try:
        kopf_objects.warning("handler failed: log-secret-value-77")
    finally:
        kopf_objects.removeHandler(collector)
    assert posted == ["handler failed: ***"]


def test_the_trackers_secret_is_masked_and_its_keys_reach_the_learners_redaction():
    api = Secrets({"s3": _secret({"AWS_SECRET_ACCESS_KEY": "s3-secret-value-1"}), "trackers": _secret({"WANDB_API_KEY": "wandb-key-value-2"})})
    job = _job("uid-1")
    job["spec"]["run"] = {"trackingSecret": "trackers"}
    assert job_secrets.named_secrets(job) == [("learner", "s3"), ("learner", "trackers")]
    assert job_secrets.redacted(api, job, "x wandb-key-value-2 s3-secret-value-1") == "x *** ***"
    pod = {"spec": {"initContainers": [], "containers": [{"name": "learner", "env": []}]}}
    job_secrets.add_redact_env(api, job, pod)
    assert pod["spec"]["containers"][0]["env"] == [{"name": job_secrets.REDACT_ENV, "value": "AWS_SECRET_ACCESS_KEY,WANDB_API_KEY"}]
