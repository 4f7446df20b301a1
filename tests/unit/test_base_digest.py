"""The base is identified by a digest of its content: written by `orbit quantize`, verified on load,
and part of the config hash, so a checkpoint is never resumed onto a different base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orbit_runtime.checkpoint.catalog import CheckpointCatalog
from orbit_runtime.checkpoint.storage import open_store
from orbit_runtime.config import parse_job_spec
from orbit_runtime.config.fingerprint import config_hash, describe_differences, training_fields
from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.base_digest import (
    MANIFEST,
    compute_base_manifest,
    read_base_digest,
    write_base_manifest,
)
from orbit_runtime.int4.quantize import quantize_checkpoint
from orbit_runtime.int4.schemes import W4A16Int
from orbit_runtime.trainer.checkpointing import plan_resume


@pytest.fixture(scope="module")
def other_source(tmp_path_factory) -> Path:
    """The demo model with other weights (seed 1): same shapes, same file sizes, another model."""
    from orbit_runtime.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("other") / "demo-seed1", seed=1)


def _quantize(src: Path, dst: Path, *, overwrite: bool = False) -> str:
    return quantize_checkpoint(src, dst, W4A16Int(group_size=128), overwrite=overwrite).base_digest


def _copy(base: Path, dst: Path) -> Path:
    return Path(shutil.copytree(base, dst))


def _fields(path: Path, digest: str | None) -> dict:
    spec = parse_job_spec({"model": {"path": str(path)}})
    return training_fields(spec, base_digest=digest)


def test_quantize_writes_manifest_and_digest_is_deterministic(demo_dir, int4_dir, other_source, tmp_path):
    manifest = json.loads((int4_dir / MANIFEST).read_text())
    files = {p.name for p in int4_dir.iterdir() if p.is_file()} - {MANIFEST}
    assert set(manifest["files"]) == files and "config.json" in files and "model.safetensors" in files
    assert manifest["digest"].startswith("sha256:") and len(manifest["digest"]) == len("sha256:") + 64
    assert read_base_digest(int4_dir) == manifest["digest"]
    assert read_base_digest(int4_dir, verify="full") == manifest["digest"]
    assert compute_base_manifest(int4_dir) == manifest  # the manifest covers exactly the files written

    again = _quantize(demo_dir, tmp_path / "again")
    assert again == manifest["digest"]  # same source, same base
    other = _quantize(other_source, tmp_path / "other")
    assert other != manifest["digest"]
    # same shapes: every file has the same size, only the content differs
    other_files = json.loads((tmp_path / "other" / MANIFEST).read_text())["files"]
    assert {k: v["size"] for k, v in other_files.items()} == {k: v["size"] for k, v in manifest["files"].items()}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: (d / "model.safetensors").open("ab").write(b"\0" * 8), "model.safetensors"),
        (lambda d: (d / "model.safetensors").open("r+b").truncate(1024), "model.safetensors"),
        (lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("4", "5", 1)), "config.json"),
        (lambda d: (d / "tokenizer_config.json").unlink(), "tokenizer_config.json"),
        (lambda d: (d / "chat_template.jinja").write_text("{{ messages }}"), "chat_template.jinja"),
    ],
    ids=["appended-shard", "truncated-shard", "edited-config", "removed-file", "added-file"],
)
def test_quick_verification_catches_a_changed_base(int4_dir, tmp_path, change, named):
    base = _copy(int4_dir, tmp_path / "base")
    if named == "chat_template.jinja" and (base / named).exists():
        (base / named).unlink()
        write_base_manifest(base)  # start from a base without it
    change(base)
    with pytest.raises(OrbitError) as exc:
        read_base_digest(base)
    message = str(exc.value)
    assert named in message and "changed after `orbit quantize`" in message
    assert "orbit quantize" in message and "--write" in message  # says how to fix it


def test_same_size_shard_edit_is_left_to_full_verification(int4_dir, tmp_path):
    base = _copy(int4_dir, tmp_path / "base")
    digest = read_base_digest(base)
    shard = base / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert read_base_digest(base) == digest  # quick: stat only for the shards
    with pytest.raises(OrbitError, match="model.safetensors"):
        read_base_digest(base, verify="full")


def test_missing_manifest_computes_the_same_digest_without_writing(int4_dir, tmp_path, caplog):
    base = _copy(int4_dir, tmp_path / "base")
    expected = read_base_digest(base)
    (base / MANIFEST).unlink()
    before = sorted(p.name for p in base.iterdir())
    with caplog.at_level("WARNING", logger="orbit_runtime.int4.base_digest"):
        assert read_base_digest(base) == expected  # a manifest written later keeps checkpoints resumable
    assert sorted(p.name for p in base.iterdir()) == before  # nothing written into the base
    assert MANIFEST in caplog.text and "computed" in caplog.text

    assert write_base_manifest(base) == expected
    assert (base / MANIFEST).is_file() and read_base_digest(base) == expected


def test_bad_manifest_and_missing_dir_are_clear(int4_dir, tmp_path):
    with pytest.raises(OrbitError, match="not a directory"):
        read_base_digest(tmp_path / "nowhere")
    base = _copy(int4_dir, tmp_path / "base")
    (base / MANIFEST).write_text("{not json")
    with pytest.raises(OrbitError, match=MANIFEST):
        read_base_digest(base)
    manifest = compute_base_manifest(base)
    manifest["digest"] = "sha256:" + "0" * 64  # hand-edited: the digest no longer matches its file list
    (base / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OrbitError, match="does not match"):
        read_base_digest(base)


def test_training_fields_identify_the_base_by_content_not_path(int4_dir, tmp_path):
    digest = read_base_digest(int4_dir)
    here, there = _fields(Path("/models/a"), digest), _fields(Path("/models/b"), digest)
    assert config_hash(here) == config_hash(there)  # one base at two paths
    assert "model.path" not in here and here["model.base_digest"] == digest
    other = _fields(Path("/models/a"), "sha256:" + "1" * 64)
    assert config_hash(other) != config_hash(here)  # two bases at one path
    assert describe_differences(here, other) == [f'model.base_digest: "{digest}" (checkpoint) -> "sha256:{"1" * 64}" (now)']
    # without a digest (old callers) the path still identifies the base
    assert training_fields(parse_job_spec({"model": {"path": "/models/a"}}))["model.path"] == "/models/a"


def test_checkpoint_on_another_base_at_the_same_path_is_not_auto_resumed(demo_dir, other_source, tmp_path):
    base = tmp_path / "base-int4"  # `make demo` rebuilds the base here
    catalog = CheckpointCatalog(open_store(f"file://{tmp_path / 'ckpt'}"))

    _quantize(demo_dir, base)
    old = _fields(base, read_base_digest(base))
    written = tmp_path / "c4"
    written.mkdir()
    (written / "state.json").write_text("{}")
    catalog.write(4, written, {"config_hash": config_hash(old), "config_fields": old})
    assert plan_resume(catalog, config_hash(old), old, resume=True, resume_from=None).entry.step == 4

    _quantize(other_source, base, overwrite=True)  # a new base at the same path
    new = _fields(base, read_base_digest(base))
    with pytest.raises(OrbitError) as refused:
        plan_resume(catalog, config_hash(new), new, resume=False, resume_from=None)
    message = str(refused.value)
    assert "different base model" in message and "model.base_digest:" in message
    assert f'"{old["model.base_digest"]}" (checkpoint) -> "{new["model.base_digest"]}" (now)' in message
    assert "--resume-from" in message

    uri = f"file://{tmp_path / 'ckpt'}/step-00000004"
    explicit = plan_resume(catalog, config_hash(new), new, resume=False, resume_from=uri)
    assert explicit.entry.step == 4 and "model.base_digest" in explicit.note
