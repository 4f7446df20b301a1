"""`orbit prepare-base`: the node cache gets one verified INT4 base per source, atomically,
under a lock two processes really contend for; clear errors; an s3:// source (moto)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orbit_runtime.base_cache import HISTORY, MODEL, cache_lock, prepare_base
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
