"""Checkpoint storage against a real S3 endpoint (moto's server on loopback) and a directory."""

from __future__ import annotations

import json
import logging
import time

import pytest

from orbit_runtime.checkpoint.catalog import CheckpointCatalog, CheckpointEntry, CorruptCheckpoint, plan_retention, step_dir
from orbit_runtime.checkpoint.storage import StorageError, open_store, validate_storage_uri
from orbit_runtime.checkpoint.writer import CheckpointWriter, StagedCheckpoint
from orbit_runtime.errors import OrbitError
from orbit_runtime.redaction import RedactingFilter, redact
from tests.s3_endpoint import ACCESS_KEY, SECRET_KEY, FaultProxy


@pytest.fixture(params=["file", "s3"])
def store_uri(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    endpoint = request.getfixturevalue("s3_env")
    return f"s3://{endpoint.new_bucket()}/runs/a"


def _local_checkpoint(tmp_path, name: str, payload: bytes = b"weights") -> object:
    d = tmp_path / name
    (d / "adapter").mkdir(parents=True)
    (d / "adapter" / "adapter_model.safetensors").write_bytes(payload)
    (d / "state.json").write_text(json.dumps({"step": 1}))
    return d


def test_store_round_trip(store_uri, tmp_path):
    store = open_store(store_uri)
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 3000)
    store.put_file("a/b.bin", src)
    store.put_bytes("a/c.json", b"{}")
    assert [(o.key, o.size) for o in store.list()] == [("a/b.bin", 3000), ("a/c.json", 2)]
    assert store.get_bytes("a/c.json") == b"{}"
    store.get_file("a/b.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    store.delete(["a/b.bin", "a/c.json"])
    assert store.list() == []


def test_manifest_last_torn_ignored_and_cleaned(store_uri, tmp_path):
    catalog = CheckpointCatalog(open_store(store_uri))
    entry = catalog.write(1, _local_checkpoint(tmp_path, "one"), {"config_hash": "h", "score": 0.5})
    assert entry.complete and entry.uri == f"{store_uri}/{step_dir(1)}"
    # a writer that died mid-upload: files, no manifest
    store = catalog.store
    store.put_file(f"{step_dir(2)}/adapter/adapter_model.safetensors", tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    entries = catalog.entries()
    assert [(e.step, e.complete) for e in entries] == [(1, True), (2, False)]
    assert [e.step for e in catalog.complete()] == [1]
    with pytest.raises(CorruptCheckpoint):
        catalog.download(entries[1], tmp_path / "nope")
    assert [e.step for e in catalog.remove_torn()] == [2]
    assert [e.step for e in catalog.entries()] == [1]


def test_missing_or_altered_file_is_not_trusted(store_uri, tmp_path):
    catalog = CheckpointCatalog(open_store(store_uri))
    catalog.write(3, _local_checkpoint(tmp_path, "three", b"A" * 100), {"config_hash": "h"})
    key = f"{step_dir(3)}/adapter/adapter_model.safetensors"
    catalog.store.put_bytes(key, b"B" * 100)  # same size, other bytes: only the checksum notices
    entry = catalog.get(3)
    assert entry.complete
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        catalog.download(entry, tmp_path / "out")
    catalog.store.delete([key])  # a file gone: the listing no longer matches the manifest
    assert not catalog.get(3).complete


def test_retention_keeps_last_n_and_best():
    def entry(step, score, complete=True):
        return CheckpointEntry(step, f"x/{step}", complete, {"score": score})

    entries = [entry(1, 0.1), entry(2, 0.9), entry(3, 0.2), entry(4, 0.3), entry(5, None, complete=False), entry(6, 0.4)]
    doomed = plan_retention(entries, keep_last=2, keep_best=1)
    assert sorted(e.step for e in doomed) == [1, 3]  # keeps 4, 6 (last two) and 2 (best); torn 5 is not retention's
    assert sorted(e.step for e in plan_retention(entries, keep_last=1, keep_best=0)) == [1, 2, 3, 4]


def test_uri_validation_never_echoes_credentials():
    for bad, fragment in [("http://x/y", "unsupported scheme"), ("s3:///p", "needs a bucket"), ("file://relative/p", "absolute")]:
        with pytest.raises(ValueError, match=fragment):
            validate_storage_uri(bad)
    with pytest.raises(OrbitError) as info:
        open_store(f"s3://{ACCESS_KEY}:{SECRET_KEY}@bucket/prefix")
    assert SECRET_KEY not in str(info.value) and ACCESS_KEY not in str(info.value)


def test_storage_errors_and_logs_are_redacted(s3_env, monkeypatch, caplog, tmp_path):
    proxy = FaultProxy(s3_env.url)
    try:
        proxy.fail()
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = open_store(f"s3://{s3_env.new_bucket()}/p", retries=1)
        with pytest.raises(StorageError) as info:
            store.put_bytes("k", b"v")
        assert "ServiceUnavailable" in str(info.value)
        assert SECRET_KEY not in str(info.value) and ACCESS_KEY not in str(info.value)
        assert proxy.counts["failed"] == 2  # botocore retried once
    finally:
        proxy.close()
    logger = logging.getLogger("orbit.test.redaction")
    logger.addFilter(RedactingFilter())
    with caplog.at_level(logging.INFO):
        logger.info("key %s secret %s url %s", ACCESS_KEY, SECRET_KEY, "https://user:pw@host/x")
    assert SECRET_KEY not in caplog.text and ACCESS_KEY not in caplog.text and "user:pw" not in caplog.text
    assert redact(f"x {SECRET_KEY} y") == "x *** y"


def test_writer_retries_while_storage_is_down_then_lands(s3_env, monkeypatch, tmp_path):
    proxy = FaultProxy(s3_env.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    bucket = s3_env.new_bucket()
    catalog = CheckpointCatalog(open_store(f"s3://{bucket}/run", retries=0, connect_timeout_s=1))
    writer = CheckpointWriter(catalog, keep_last=1, keep_best=0, backoff_s=(0.05, 0.2))
    try:
        proxy.go_down()  # connections refused
        writer.submit(StagedCheckpoint(1, _local_checkpoint(tmp_path, "s1"), {"config_hash": "h"}))
        deadline = time.monotonic() + 30
        while writer.stats.failures < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer.stats.failures >= 2 and writer.stats.successes == 0
        # a newer checkpoint replaces the one that never landed
        writer.submit(StagedCheckpoint(2, _local_checkpoint(tmp_path, "s2"), {"config_hash": "h"}))
        assert not (tmp_path / "s1").exists() or writer.pending_step == 2
        proxy.come_back()
        assert writer.wait(30)
        assert writer.stats.last_success_step == 2
        assert [e.step for e in catalog.complete()] == [2]
        events = writer.events()
        assert any(not e["ok"] for e in events) and events[-1]["ok"] and events[-1]["step"] == 2
        assert all(SECRET_KEY not in json.dumps(e) for e in events)
        assert not (tmp_path / "s2").exists()  # the staged copy is removed once it landed
    finally:
        writer.close()
        proxy.close()


def test_writer_applies_retention_and_removes_torn(tmp_path):
    catalog = CheckpointCatalog(open_store(f"file://{tmp_path / 'ckpt'}"))
    catalog.store.put_bytes(f"{step_dir(1)}/state.json", b"{}")  # torn leftover of an earlier life
    writer = CheckpointWriter(catalog, keep_last=2, keep_best=1)
    try:
        for step, score in [(2, 0.9), (3, 0.1), (4, 0.2), (5, 0.3)]:
            writer.submit(StagedCheckpoint(step, _local_checkpoint(tmp_path, f"s{step}"), {"config_hash": "h", "score": score}))
            assert writer.wait(10)
    finally:
        writer.close()
    assert [(e.step, e.complete) for e in catalog.entries()] == [(2, True), (4, True), (5, True)]


def test_credentials_from_a_mounted_secret_file(s3_env, monkeypatch, tmp_path):
    # In a pod the Secret is mounted as a file and AWS_SHARED_CREDENTIALS_FILE points at it.
    bucket = s3_env.new_bucket()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "missing"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "missing-config"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws of the machine running the tests
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # nor a cloud instance's role
    with pytest.raises(StorageError, match="credentials"):
        open_store(f"s3://{bucket}/p", retries=0).put_bytes("k", b"v")
    secret = tmp_path / "secret" / "credentials"
    secret.parent.mkdir()
    secret.write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(secret))
    store = open_store(f"s3://{bucket}/p", retries=0)
    store.put_bytes("k", b"v")
    assert store.get_bytes("k") == b"v"
