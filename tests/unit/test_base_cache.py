"""`orbit prepare-base`: the node cache gets one verified INT4 base per source, atomically,
under a lock two processes really contend for; clear errors; an s3:// source (moto)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orbit_runtime.base_cache import HISTORY, LAST_USED, MODEL, SOURCE_RECORD, base_model_config, cache_lock, prepare_base
from orbit_runtime.base_source import source_fingerprint
from orbit_runtime.cli import app
from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.base_digest import MANIFEST, read_base_digest


def _history(cache: Path) -> list[dict]:
    return json.loads((cache / HISTORY).read_text())


def test_a_hf_source_is_quantized_once_then_verified(demo_dir, tmp_path):
    cache = tmp_path / "base-abc"
    cache.mkdir()
    first = prepare_base(cache, "hf", str(demo_dir))
    assert first.action == "quantized" and (cache / MODEL / MANIFEST).is_file()
    assert first.digest == read_base_digest(cache / MODEL, verify="full")
    second = prepare_base(cache, "hf", str(demo_dir))
    assert second.reused and second.digest == first.digest
    assert [h["action"] for h in _history(cache)] == ["quantized", "verified"]
    assert not list(cache.glob(".tmp-*"))


def test_an_int4_source_is_copied_and_verified_and_a_changed_cache_is_refused(int4_dir, tmp_path):
    cache = tmp_path / "base-int4"
    cache.mkdir()
    result = prepare_base(cache, "int4", str(int4_dir))
    assert result.action == "copied" and result.digest == read_base_digest(int4_dir)
    (cache / MODEL / "config.json").write_text((cache / MODEL / "config.json").read_text() + " ")  # tampered
    with pytest.raises(OrbitError, match="config.json"):
        prepare_base(cache, "int4", str(int4_dir))


def test_clear_errors(demo_dir, int4_dir, tmp_path):
    cache = tmp_path / "c"
    cache.mkdir()
    with pytest.raises(OrbitError, match="source directory does not exist"):
        prepare_base(cache, "hf", str(tmp_path / "missing"))
    with pytest.raises(OrbitError, match="no config.json"):
        prepare_base(cache, "int4", str(tmp_path))
    with pytest.raises(OrbitError, match="not quantized|quantization_config"):
        prepare_base(cache, "int4", str(demo_dir))  # a 16-bit checkpoint is not an INT4 base
    with pytest.raises(OrbitError, match="no base here, and no source"):
        prepare_base(cache, "int4", None)  # a nodeCache name nobody placed
    assert not list(cache.glob(".tmp-*")) and not (cache / MODEL).exists()
    result = CliRunner().invoke(app, ["prepare-base", "--cache", str(cache), "--format", "hf", "--source", str(tmp_path / "x")])
    assert result.exit_code == 1 and "does not exist" in result.output and "Traceback" not in result.output


def test_concurrent_pods_on_one_node_quantize_once(demo_dir, tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    command = [sys.executable, "-m", "orbit_runtime.cli", "prepare-base", "--cache", str(cache), "--source", str(demo_dir)]
    with cache_lock(cache, 5.0):  # a third writer holds the lock: both pods must wait for it
        procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        time.sleep(8)
        assert all(p.poll() is None for p in procs)  # still waiting
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    history = _history(cache)
    assert sorted(h["action"] for h in history) == ["quantized", "verified"]  # one writer; the other then verified
    assert all(h["waited_for_lock_s"] > 1.0 for h in history)


def test_a_node_cache_base_is_verified_without_writing(int4_dir, tmp_path):
    cache = tmp_path / "named"
    (cache / MODEL).mkdir(parents=True)
    for path in int4_dir.iterdir():
        if path.is_file():
            (cache / MODEL / path.name).write_bytes(path.read_bytes())
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    result = prepare_base(cache, "int4", None)  # the pod mounts an administrator's base read-only
    assert result.reused and result.digest == read_base_digest(int4_dir)
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == before  # no lock file, no history, nothing


def test_a_pod_killed_mid_write_leaves_nothing_trusted(demo_dir, tmp_path):
    cache = tmp_path / "killed"
    cache.mkdir()
    half = cache / ".tmp-dead"
    (half / MODEL).mkdir(parents=True)
    (half / MODEL / "config.json").write_text("{}")  # a partial copy of a dead writer
    with cache_lock(cache, 1.0):
        pass  # the dead writer's lock died with it
    result = prepare_base(cache, "hf", str(demo_dir))
    assert result.action == "quantized" and not half.exists()


def test_an_s3_source(demo_dir, tmp_path, s3_env):
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    for path in demo_dir.iterdir():
        if path.is_file():
            client.upload_file(str(path), bucket, f"models/demo/{path.name}")
    cache = tmp_path / "from-s3"
    cache.mkdir()
    result = prepare_base(cache, "hf", f"s3://{bucket}/models/demo")
    assert result.action == "quantized" and (cache / MODEL / MANIFEST).is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OrbitError, match="no files under this prefix"):
        prepare_base(empty, "hf", f"s3://{bucket}/models/none")


# ---- keyed by content: the source's fingerprint is recorded with the base ------------------------


def endpoint_id(url: str) -> str:
    """What a fingerprint records of an endpoint: 16 hex characters of its sha256."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def _upload(client, bucket: str, prefix: str, model_dir: Path) -> None:
    for path in model_dir.iterdir():
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> Path:
    """A checkpoint with other weights than demo_dir's (what a re-upload puts under the same prefix)."""
    from orbit_runtime.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("other") / "demo", seed=1)


def test_a_reuploaded_s3_checkpoint_is_rebuilt_not_reused(demo_dir, other_model, tmp_path, s3_env):
    bucket, client = s3_env.new_bucket(), s3_env.client()
    _upload(client, bucket, "models/demo", demo_dir)
    cache = tmp_path / "base-s3"
    cache.mkdir()
    first = prepare_base(cache, "hf", f"s3://{bucket}/models/demo")
    again = prepare_base(cache, "hf", f"s3://{bucket}/models/demo")
    assert (first.action, again.action, again.digest) == ("quantized", "verified", first.digest)
    first_inode = (cache / MODEL).stat().st_ino  # what a running pod's subPath mount holds

    _upload(client, bucket, "models/demo", other_model)  # the same URI, other weights
    rebuilt = prepare_base(cache, "hf", f"s3://{bucket}/models/demo")
    assert rebuilt.action == "quantized", "the stale base of the old upload was reused"
    assert (first.reason, again.reason) == ("new", "source unchanged")
    assert rebuilt.reason.startswith("source changed: ") and "model.safetensors" in rebuilt.reason
    assert rebuilt.digest != first.digest and read_base_digest(cache / MODEL, verify="full") == rebuilt.digest
    (old,) = cache.glob(".old-*")  # renamed aside, not deleted: a running pod keeps reading it
    assert old.stat().st_ino == first_inode and read_base_digest(old, verify="full") == first.digest
    assert [(h["action"], h["reason"].split(":")[0]) for h in _history(cache)] == [
        ("quantized", "new"), ("verified", "source unchanged"), ("quantized", "source changed")]  # fmt: skip
    assert prepare_base(cache, "hf", f"s3://{bucket}/models/demo").reused


def test_the_same_uri_behind_another_endpoint_is_rebuilt(demo_dir, other_model, tmp_path, s3_env, monkeypatch):
    """The endpoint comes from the base's Secret, every key of which the operator names in ORBIT_REDACT_ENV: a masked
    endpoint would make every endpoint look the same, so the fingerprint holds a hash of it, never the URL."""
    from moto.server import ThreadedMotoServer

    from tests.s3_endpoint import S3Endpoint

    bucket = s3_env.new_bucket()
    _upload(s3_env.client(), bucket, "m", demo_dir)
    cache = tmp_path / "base-endpoint"
    cache.mkdir()
    host_side = source_fingerprint(f"s3://{bucket}/m")  # tests/e2e's _ensure_base_in_cache: a prepare without ORBIT_REDACT_ENV
    monkeypatch.setenv("ORBIT_REDACT_ENV", "AWS_ENDPOINT_URL,AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY,AWS_DEFAULT_REGION")
    first = prepare_base(cache, "hf", f"s3://{bucket}/m")  # as the pod's prepare-base runs it
    recorded = json.loads((cache / MODEL / SOURCE_RECORD).read_text())["source"]
    assert recorded == host_side and recorded["endpoint"] == endpoint_id(s3_env.url) != endpoint_id("http://other")
    assert len(recorded["endpoint"]) == 16 and s3_env.url not in json.dumps(recorded)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # another S3, same bucket name
    server.start()
    try:
        host, port = server.get_host_and_port()
        other = S3Endpoint(f"http://{host}:{port}")
        other.client().create_bucket(Bucket=bucket)
        _upload(other.client(), bucket, "m", other_model)
        monkeypatch.setenv("AWS_ENDPOINT_URL", other.url)
        second = prepare_base(cache, "hf", f"s3://{bucket}/m")
    finally:
        server.stop()
    assert second.action == "quantized" and f"endpoint changed (its hash {endpoint_id(s3_env.url)} -> {endpoint_id(other.url)})" in second.reason
    assert second.digest != first.digest and other.url not in (cache / MODEL / SOURCE_RECORD).read_text()


def test_a_directory_source_is_fingerprinted_by_metadata(demo_dir, tmp_path):
    source = tmp_path / "pvc"
    shutil.copytree(demo_dir, source)
    cache = tmp_path / "base-dir"
    cache.mkdir()
    first = prepare_base(cache, "hf", str(source))
    recorded = json.loads((cache / MODEL / SOURCE_RECORD).read_text())
    assert recorded["format"] == "hf" and recorded["groupSize"] == 128
    assert {f[0] for f in recorded["source"]["files"]} == {p.name for p in source.iterdir() if p.is_file()}
    assert prepare_base(cache, "hf", str(source)).reason == "source unchanged"
    (source / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text() + " ")
    changed = prepare_base(cache, "hf", str(source))
    assert changed.action == "quantized" and "tokenizer_config.json" in changed.reason
    assert changed.digest != first.digest  # the tokenizer file is part of the base


def test_a_base_from_before_fingerprints_is_rebuilt_once(demo_dir, tmp_path):
    cache = tmp_path / "base-legacy"
    cache.mkdir()
    prepare_base(cache, "hf", str(demo_dir))
    (cache / MODEL / SOURCE_RECORD).unlink()  # what the previous prepare-base left
    legacy = prepare_base(cache, "hf", str(demo_dir))
    assert legacy.action == "quantized" and legacy.reason.startswith("no source fingerprint recorded")
    assert prepare_base(cache, "hf", str(demo_dir)).reason == "source unchanged"


def test_an_unreadable_source_reuses_the_base_it_built_and_says_so(demo_dir, tmp_path):
    source = tmp_path / "gone"
    shutil.copytree(demo_dir, source)
    cache = tmp_path / "base-gone"
    cache.mkdir()
    first = prepare_base(cache, "hf", str(source))
    shutil.rmtree(source)  # the checkpoint was deleted once it was prepared
    reused = prepare_base(cache, "hf", str(source))
    assert reused.reused and reused.digest == first.digest and reused.reason.startswith("source not checked")


def test_an_empty_model_mount_point_is_prepared_again(demo_dir, tmp_path):
    cache = tmp_path / "base-evicted"
    (cache / MODEL).mkdir(parents=True)  # the kubelet made it: a role restarted after cache-cleanup evicted the base
    assert prepare_base(cache, "hf", str(demo_dir)).action == "quantized"
    assert (cache / LAST_USED).is_file()  # every preparation stamps the base's last use


def test_the_prepare_result_reaches_the_termination_message(demo_dir, tmp_path):
    cache, message = tmp_path / "base-cli", tmp_path / "termination-log"
    cache.mkdir()
    command = ["prepare-base", "--cache", str(cache), "--source", str(demo_dir), "--termination-log", str(message)]
    assert CliRunner().invoke(app, command).exit_code == 0
    assert json.loads(message.read_text())["base"].startswith("quantized (new): sha256:")
    assert CliRunner().invoke(app, command).exit_code == 0
    assert json.loads(message.read_text())["base"].startswith("verified (source unchanged): sha256:")


def test_prepare_base_writes_the_digest_the_roles_check(demo_dir, tmp_path):
    cache, base_id = tmp_path / "base-id-cli", tmp_path / "base-id" / "digest"
    cache.mkdir()
    base_id.parent.mkdir()
    result = CliRunner().invoke(app, ["prepare-base", "--cache", str(cache), "--source", str(demo_dir), "--base-id", str(base_id)])
    assert result.exit_code == 0, result.output
    assert base_id.read_text().strip() == read_base_digest(cache / MODEL) and not list(base_id.parent.glob(".*"))


def test_the_plan_reads_a_changed_sources_config_not_the_stale_base(demo_dir, tmp_path):
    source = tmp_path / "pvc"
    shutil.copytree(demo_dir, source)
    cache = tmp_path / "base-plan"
    cache.mkdir()
    prepare_base(cache, "hf", str(source))
    assert "quantization_config" in base_model_config(cache, str(source))  # unchanged: the prepared base's
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 99}))
    assert base_model_config(cache, str(source))["num_hidden_layers"] == 99  # re-uploaded: planned with what will be built


# ---- a source that cannot be listed: reused only while the failure may pass ----------------------


def test_a_refused_listing_fails_naming_the_source_and_a_transient_one_reuses(demo_dir, tmp_path, s3_env, monkeypatch):
    from tests.s3_endpoint import FaultProxy

    bucket = s3_env.new_bucket()
    _upload(s3_env.client(), bucket, "m", demo_dir)
    source, cache = f"s3://{bucket}/m", tmp_path / "base-refused"
    cache.mkdir()
    proxy = FaultProxy(s3_env.url)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        first = prepare_base(cache, "hf", source)
        proxy.fail()  # 503 ServiceUnavailable to everything (after botocore's retries): it may pass
        reused = prepare_base(cache, "hf", source)
        assert reused.reused and reused.digest == first.digest and reused.reason.startswith("source not checked")
    finally:
        proxy.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.url)
    s3_env.client().delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in s3_env.keys(bucket)]})
    s3_env.client().delete_bucket(Bucket=bucket)  # or the credentials' endpoint has no such bucket
    with pytest.raises(OrbitError, match=rf"{source}: the base's source refused the listing .*NoSuchBucket"):
        prepare_base(cache, "hf", source)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # no credentials at all (a Secret without them)
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(OrbitError, match=rf"{source}: the base's source refused the listing .*NoCredentialsError"):
        prepare_base(cache, "hf", source)
    assert [h["action"] for h in _history(cache)] == ["quantized", "verified"]  # the refusals reused nothing


# ---- replaced bases: no swap for the same digest, and no pile of .old-* ---------------------------


def test_a_rebuild_with_the_same_digest_keeps_the_base_in_place(demo_dir, tmp_path):
    source = tmp_path / "pvc"
    shutil.copytree(demo_dir, source)
    cache = tmp_path / "base-same"
    cache.mkdir()
    first = prepare_base(cache, "hf", str(source))
    inode = (cache / MODEL).stat().st_ino
    (source / "config.json").write_bytes((source / "config.json").read_bytes())  # rewritten, same bytes: a new fingerprint
    again = prepare_base(cache, "hf", str(source))
    assert again.action == "quantized" and again.digest == first.digest and "kept in place" in again.reason
    assert (cache / MODEL).stat().st_ino == inode and not list(cache.glob(".old-*")) and not list(cache.glob(".tmp-*"))
    assert json.loads((cache / MODEL / SOURCE_RECORD).read_text())["source"] == source_fingerprint(str(source))
    assert prepare_base(cache, "hf", str(source)).reason == "source unchanged"


def test_prepare_base_removes_the_replaced_bases_nobody_holds(demo_dir, tmp_path):
    cache = tmp_path / "base-old"
    cache.mkdir()
    prepare_base(cache, "hf", str(demo_dir))
    now = int(time.time())
    olds = {name: cache / f".old-{stamp}-{name}" for name, stamp in [("idle", now - 3600), ("held", now - 3600), ("recent", now - 5)]}
    for old in olds.values():
        old.mkdir()
        (old / "model.safetensors").write_bytes(b"w" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)", str(olds["held"])],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"  # a running pod's role reads that one
        result = prepare_base(cache, "hf", str(demo_dir))
    finally:
        holder.kill()
        holder.wait()
    assert result.reused and "removed 1 replaced base(s)" in result.reason
    assert not olds["idle"].exists() and olds["held"].is_dir() and olds["recent"].is_dir()  # recent: its pod may be starting


def test_the_swap_falls_back_to_two_renames_without_renameat2(demo_dir, other_model, tmp_path, monkeypatch):
    import orbit_runtime.base_cache as base_cache

    source = tmp_path / "pvc"
    shutil.copytree(demo_dir, source)
    cache = tmp_path / "base-fallback"
    cache.mkdir()
    first = prepare_base(cache, "hf", str(source))
    inode = (cache / MODEL).stat().st_ino
    calls = []
    monkeypatch.setattr(base_cache, "exchange", lambda a, b: calls.append((a, b)) or False)  # an old kernel or libc
    shutil.copy2(other_model / "model.safetensors", source / "model.safetensors")
    rebuilt = prepare_base(cache, "hf", str(source))
    assert calls and rebuilt.digest != first.digest and read_base_digest(cache / MODEL, verify="full") == rebuilt.digest
    (old,) = cache.glob(".old-*")
    assert old.stat().st_ino == inode


def test_a_directory_rewritten_with_its_size_and_mtime_kept_is_seen(demo_dir, tmp_path):
    """The ctime is in the fingerprint: a rewrite that keeps the size and restores the mtime changes it."""
    source = tmp_path / "pvc"
    shutil.copytree(demo_dir, source)
    cache = tmp_path / "base-ctime"
    cache.mkdir()
    first = prepare_base(cache, "hf", str(source))
    path = source / "chat_template.jinja"
    stat, data = path.stat(), path.read_bytes()
    time.sleep(0.05)
    path.write_bytes(data[:-1] + (b"\n" if data[-1:] != b"\n" else b" "))  # other bytes, the same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the mtime put back
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    changed = prepare_base(cache, "hf", str(source))
    assert changed.action == "quantized" and "chat_template.jinja" in changed.reason and changed.digest != first.digest
