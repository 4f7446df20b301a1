"""A cached base as the pod's roles hold it: the atomic swap (a real renameat2 on this machine), the
identity check a role makes at start (against the digest its pod's prepare-base recorded), and the
lease each of the three role commands takes (checked from another process, with a real flock)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

import orbit_runtime.base_lease as base_lease
from orbit_runtime.base_lease import check_base_identity, exchange, write_base_id
from orbit_runtime.cli import app
from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.base_digest import read_base_digest


def _tree(path: Path, marker: str) -> Path:
    path.mkdir(parents=True)
    (path / "which").write_text(marker)
    return path


def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    a, b = _tree(tmp_path / "model", "old"), _tree(tmp_path / ".tmp-x" / "model", "new")
    inodes = a.stat().st_ino, b.stat().st_ino
    assert exchange(b, a) is True  # Linux >= 3.15, glibc >= 2.28: the test machine has both
    assert (a / "which").read_text() == "new" and (b / "which").read_text() == "old"
    assert (a.stat().st_ino, b.stat().st_ino) == inodes[::-1]  # the directories moved, nothing was copied
    with pytest.raises(FileNotFoundError):
        exchange(tmp_path / "missing", a)  # a real failure is raised, not taken for "unavailable"


def test_exchange_says_so_where_renameat2_is_missing(tmp_path, monkeypatch):
    a, b = _tree(tmp_path / "a", "a"), _tree(tmp_path / "b", "b")
    monkeypatch.setattr(base_lease.ctypes, "CDLL", lambda *args, **kwargs: SimpleNamespace())  # an old libc: no symbol
    assert exchange(a, b) is False and (a / "which").read_text() == "a"  # the caller renames twice instead


def test_a_role_refuses_a_base_that_is_not_its_pods(int4_dir, tmp_path, monkeypatch):
    base_id = tmp_path / "base-id" / "digest"
    base_id.parent.mkdir()
    check_base_identity(int4_dir, base_id)  # no file (not in a pod, or a pod from before): not checked
    write_base_id(base_id, read_base_digest(int4_dir))
    monkeypatch.setattr("orbit_runtime.int4.base_digest.file_sha256", lambda path: pytest.fail(f"hashed {path}"))
    check_base_identity(int4_dir, base_id)  # the same base: fine, from the manifest alone (no hashing)
    write_base_id(base_id, "sha256:" + "0" * 64)  # prepare-base prepared another base (since swapped out)
    with pytest.raises(OrbitError, match=r"the node's base changed under this pod: .* holds sha256:\w+, but this pod's "
                                         r"prepare-base prepared sha256:0{64}"):  # fmt: skip
        check_base_identity(int4_dir, base_id)
    empty = tmp_path / "evicted"
    empty.mkdir()  # the kubelet's empty mount point after cache-cleanup evicted the base
    with pytest.raises(OrbitError, match="holds no base"):
        check_base_identity(empty, base_id)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file():
            (dst / path.name).write_bytes(path.read_bytes())
    return dst


def _exclusive_from_another_process(path: Path) -> bool:
    """Whether another process gets LOCK_EX|LOCK_NB on PATH (cache-cleanup's test before it evicts)."""
    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
            "except BlockingIOError:\n    print('held')")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True).stdout.strip()
    return out == "free"


def _close_descriptors_of(path: Path) -> int:
    """Close this process's descriptors open on PATH (the leases the role commands took in-process)."""
    closed = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                os.close(int(fd))
                closed += 1
        except OSError:
            pass
    return closed


@pytest.mark.parametrize("role", ["rollout", "reference", "learner"])
def test_each_role_takes_the_lease_and_checks_the_base_first(role, int4_dir, tmp_path, monkeypatch):
    """Each role command, first thing: a shared flock on its base (cache-cleanup's LOCK_EX|LOCK_NB from another
    process then fails), then the identity check: a base swapped in after this pod's prepare-base stops it."""
    model = _copy(int4_dir, tmp_path / "base")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(model)}, "rewards": [{"function": "exact_match"}],
                                      "run": {"output_dir": str(tmp_path / "runs")}}))  # fmt: skip
    base_id = tmp_path / "base-id" / "digest"
    base_id.parent.mkdir()
    write_base_id(base_id, "sha256:" + "f" * 64)  # not this base: the role must stop before doing anything else
    monkeypatch.setattr(base_lease, "BASE_ID_FILE", base_id)
    assert _exclusive_from_another_process(model)
    message = tmp_path / "termination-log"
    extra = ["--wait-seconds", "1", "--termination-log", str(message)] if role == "learner" else []
    try:
        result = CliRunner().invoke(app, [role, str(config), *extra])
        assert result.exit_code == 2, (result.output, result.exception)
        assert "the node's base changed under this pod" in result.output and "Traceback" not in result.output
        assert not _exclusive_from_another_process(model)  # the lease this process took (a role holds it for life)
    finally:
        assert _close_descriptors_of(model) >= 1
    assert _exclusive_from_another_process(model)
    if role == "learner":
        assert message.read_text().startswith("error: the node's base changed under this pod")


def test_the_lease_is_shared_and_inheritable(int4_dir, tmp_path):
    model = _copy(int4_dir, tmp_path / "base")
    fd = base_lease.hold_base_lease(model)
    other = base_lease.hold_base_lease(model)  # a second role of the pod on the same base: shared
    try:
        assert fd is not None and other is not None and os.get_inheritable(fd)
        assert base_lease.unleased(model) is None and not _exclusive_from_another_process(model)
    finally:
        os.close(fd)
        os.close(other)
    held = base_lease.unleased(model)
    assert held is not None  # nobody holds it now: cache-cleanup or prepare-base may remove it
    with pytest.raises(BlockingIOError):
        probe = os.open(model, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(probe)
    os.close(held)
