"""`orbit cache-cleanup`: the node cache is kept under its limit, least recently used first, and never
loses a base that is kept, an administrator's, being prepared, in use by a running role, or recently used.
The choice is a pure function; the I/O runs on a real directory tree, with real flocks held by other processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from orbit_runtime.base_cache import HISTORY, LAST_USED, MODEL, cache_lock
from orbit_runtime.cache_cleanup import Entry, cleanup, disk_usage, last_used, plan_evictions, scan
from orbit_runtime.cli import app

MIB = 1 << 20
NOW = 1_800_000_000.0
HOUR = 3600.0


def _paths(plan: list[Entry]) -> list[str]:
    return [e.path for e in plan]


# ---- the pure choice ------------------------------------------------------------------------------


def test_the_least_recently_used_go_first_until_under_the_limit():
    entries = [Entry("base-a", "base-a", 40, NOW - 10 * HOUR), Entry("base-b", "base-b", 30, NOW - 30 * HOUR),
               Entry("base-c", "base-c", 20, NOW - 20 * HOUR), Entry("base-d", "base-d", 10, NOW - 40 * HOUR)]  # fmt: skip
    # 100 in all, limit 55: d (oldest) then b, then 60 > 55, so c too; a is the most recent and stays
    assert _paths(plan_evictions(entries, 55, "", HOUR, NOW)) == ["base-d", "base-b", "base-c"]
    assert plan_evictions(entries, 100, "", HOUR, NOW) == []  # at the limit: nothing
    assert _paths(plan_evictions(entries, 0, "base-d", HOUR, NOW)) == ["base-b", "base-c", "base-a"]  # kept: never


def test_protected_entries_never_qualify_and_retired_copies_always_do():
    entries = [Entry("base-keep", "base-keep", 50, NOW - 99 * HOUR),
               Entry("base-keep/.old-1-aa", "base-keep", 5, NOW - 9 * HOUR, retired=True),
               Entry("named/llama", "named/llama", 50, NOW - 99 * HOUR, pinned="an administrator's base"),
               Entry("base-recent", "base-recent", 50, NOW - 0.5 * HOUR),
               Entry("base-recent/.old-2-bb", "base-recent", 5, NOW - 0.5 * HOUR, retired=True),
               Entry("base-busy", "base-busy", 50, NOW - 99 * HOUR, pinned="being prepared"),
               Entry("base-old", "base-old", 50, NOW - 9 * HOUR),
               Entry("base-old/.old-3-cc", "base-old", 5, NOW - 20 * HOUR, retired=True)]  # fmt: skip
    plan = plan_evictions(entries, 10**9, "base-keep", HOUR, NOW)  # far under the limit: only the retired copies
    assert _paths(plan) == ["base-old/.old-3-cc", "base-keep/.old-1-aa"]  # oldest first; not the recent one
    plan = plan_evictions(entries, 0, "base-keep", HOUR, NOW)
    assert _paths(plan) == ["base-old/.old-3-cc", "base-keep/.old-1-aa", "base-old"]


# ---- on a real tree ----------------------------------------------------------------------------


def _base(root: Path, name: str, mib: int, used_hours_ago: float | None, now: float) -> Path:
    base = root / name
    (base / MODEL).mkdir(parents=True)
    (base / MODEL / "model.safetensors").write_bytes(os.urandom(mib * MIB))
    (base / MODEL / "config.json").write_text("{}")
    if used_hours_ago is not None:
        (base / LAST_USED).touch()
        os.utime(base / LAST_USED, (now - used_hours_ago * HOUR,) * 2)
    else:
        os.utime(base / MODEL, (now - 50 * HOUR,) * 2)  # no stamp (a base from before stamps): its model's mtime
    return base


def test_cleanup_evicts_the_oldest_until_under_the_limit_and_keeps_the_protected(tmp_path):
    root, now = tmp_path / "bases", time.time()
    root.mkdir()
    _base(root, "base-mine", 4, 30, now)  # the pod's own: kept although the oldest but one
    _base(root, "base-old", 4, 20, now)
    _base(root, "base-older", 4, None, now)  # no stamp: model mtime 50 h ago, the oldest
    _base(root, "base-recent", 4, 0.1, now)  # a pod started on it a few minutes ago
    _base(root, "base-newer", 4, 10, now)
    _base(root / "named", "llama", 4, 90, now)  # an administrator's
    (root / "base-old" / ".old-123-aa").mkdir()
    (root / "base-old" / ".old-123-aa" / "w").write_bytes(os.urandom(2 * MIB))  # a replaced copy
    total = disk_usage(root)
    assert total >= 26 * MIB

    result = cleanup(root, 17 * MIB, "base-mine", HOUR, now=now)
    # the .old-* first, then the least recently used until under 17 MiB: older (50 h), old (20 h); mine, recent, named stay
    assert result.evicted == ["base-old/.old-123-aa", "base-older", "base-old"]
    assert not result.over_limit and disk_usage(root) <= 17 * MIB and result.remaining_bytes <= 17 * MIB
    assert result.freed_bytes >= 10 * MIB and total - disk_usage(root) >= result.freed_bytes - MIB
    for kept in ("base-mine", "base-recent", "base-newer", "named/llama"):
        assert (root / kept / MODEL / "model.safetensors").is_file(), kept
    for evicted in ("base-older", "base-old"):
        assert (root / evicted).is_dir() and not (root / evicted / MODEL).exists()  # the directory (and its lock) stays
        assert not list((root / evicted).glob(".tmp-*"))
    assert "evicted 3" in result.summary()


def test_a_base_being_prepared_or_in_use_is_skipped_and_the_next_one_taken(tmp_path):
    root, now = tmp_path / "bases", time.time()
    root.mkdir()
    _base(root, "base-preparing", 2, 40, now)
    _base(root, "base-running", 2, 30, now)
    _base(root, "base-idle", 2, 20, now)
    running = root / "base-running" / MODEL
    # a role of a running pod: holds its lease for its whole life (orbit_runtime.base_lease.hold_base_lease)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from orbit_runtime.base_lease import hold_base_lease; "
                               f"assert hold_base_lease(Path({str(running)!r})) is not None; print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with cache_lock(root / "base-preparing", 1.0):  # another pod's prepare-base is writing it
            result = cleanup(root, 2 * MIB + 64 * 1024, "", HOUR, now=now)
    finally:
        holder.kill()
        holder.wait()
    assert result.skipped == {"base-preparing": "being prepared", "base-running": "in use by a running pod"}
    assert result.evicted == ["base-idle"] and result.over_limit  # nothing else may go: still over, and it says so
    assert "still over the limit" in result.summary()
    assert (running / "model.safetensors").is_file() and (root / "base-preparing" / MODEL).is_dir()
    # lock and lease released: of the two left, the least recently used goes, and that is enough
    assert cleanup(root, 2 * MIB + 64 * 1024, "", HOUR, now=now).evicted == ["base-preparing"]


def test_a_replaced_base_a_running_pod_still_reads_is_kept(tmp_path):
    root, now = tmp_path / "bases", time.time()
    root.mkdir()
    _base(root, "base-x", 1, 0.0, now)
    old = root / "base-x" / f".old-{int(now - 10 * HOUR)}-ab"
    old.mkdir()
    (old / "w").write_bytes(b"x" * 4096)
    fd = os.open(old, os.O_RDONLY | os.O_DIRECTORY)  # this process as the running pod's role
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_SH)
        result = cleanup(root, 10**12, "", HOUR, now=now)
        assert result.skipped == {f"base-x/{old.name}": "in use by a running pod"} and old.is_dir()
    finally:
        os.close(fd)
    assert cleanup(root, 10**12, "", HOUR, now=now).evicted == [f"base-x/{old.name}"] and not old.exists()


def test_scan_counts_foreign_directories_but_never_evicts_them(tmp_path):
    root = tmp_path / "bases"
    (root / "lost+found").mkdir(parents=True)
    (root / "lost+found" / "f").write_bytes(b"x" * 8192)
    (entry,) = scan(root)
    assert entry.pinned == "not a base directory" and entry.size >= 8192
    assert cleanup(root, 0, None, 0).evicted == []


def test_the_command_writes_its_result_and_never_fails_the_pod(tmp_path):
    root, now, message = tmp_path / "bases", time.time(), tmp_path / "termination-log"
    root.mkdir()
    _base(root, "base-a", 1, 48, now)
    command = ["cache-cleanup", "--root", str(root), "--max-bytes", "0", "--keep", "base-b", "--min-idle-seconds", "3600",
               "--termination-log", str(message)]  # fmt: skip
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0 and "evicted 1" in result.output
    report = json.loads(message.read_text())
    assert report["evicted"] == 1 and report["freedBytes"] >= MIB and report["cleanup"].startswith("cache 0.0 GiB of 0.0 GiB")
    missing = CliRunner().invoke(app, [*command[:2], str(tmp_path / "nowhere"), *command[3:]])
    assert missing.exit_code == 0 and "did nothing" in missing.output  # best effort: the job still starts
    assert json.loads(message.read_text())["cleanup"].startswith("did nothing")


def test_the_lease_survives_exec_as_orbit_rollout_hands_it_to_vllm(tmp_path):
    root, now = tmp_path / "bases", time.time()
    root.mkdir()
    model = _base(root, "base-served", 1, 48, now) / MODEL
    code = ("import os, sys; from pathlib import Path; from orbit_runtime.base_lease import hold_base_lease; "
            f"assert hold_base_lease(Path({str(model)!r})) is not None; "
            "os.execv(sys.executable, [sys.executable, '-c', 'import time; print(\"serving\", flush=True); time.sleep(60)'])")  # fmt: skip
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "serving"  # another program now, holding the lease it inherited
        assert cleanup(root, 0, None, HOUR, now=now).skipped == {"base-served": "in use by a running pod"}
    finally:
        server.kill()
        server.wait()
    assert cleanup(root, 0, None, HOUR, now=now).evicted == ["base-served"]


# ---- review fixes: the LRU clock of older bases, sizes, links, a cleanup that crashes ---------------


def test_a_base_from_before_stamps_is_dated_by_its_history_not_its_model(tmp_path):
    """The prepare-base of before stamps rewrote prepared.json at every pod start: that, not the model's
    mtime (the day it was built), says when the base was last used."""
    root, now = tmp_path / "bases", time.time()
    root.mkdir()
    used = _base(root, "base-used-daily", 1, None, now)  # built 50 h ago, no stamp...
    (used / HISTORY).write_text("[]")
    os.utime(used / HISTORY, (now - 0.2 * HOUR,) * 2)  # ...but a pod started on it 12 minutes ago
    _base(root, "base-stale", 1, 5, now)
    assert last_used(used) == os.stat(used / HISTORY).st_mtime
    assert cleanup(root, 0, None, HOUR, now=now).evicted == ["base-stale"]  # not the one in daily use
    assert (used / MODEL / "model.safetensors").is_file()


def test_a_second_run_evicts_nothing_more_and_sizes_are_the_models(tmp_path):
    root, now = tmp_path / "bases", time.time()
    root.mkdir()
    for name in ("base-a", "base-b"):
        base = _base(root, name, 1, 48, now)
        (base / HISTORY).write_bytes(b"x" * 64 * 1024)  # bookkeeping: counted, never what an eviction frees
    first, second = cleanup(root, 0, None, HOUR, now=now), cleanup(root, 0, None, HOUR, now=now)
    assert sorted(first.evicted) == ["base-a", "base-b"]
    assert second.evicted == [] and second.freed_bytes == 0  # nothing left to evict: already evicted
    assert 2 * MIB <= first.freed_bytes < 2 * MIB + 64 * 1024  # the two models (and their config.json), not prepared.json
    assert second.total_bytes >= 2 * 64 * 1024  # what is left is still counted


def test_a_model_that_is_a_symlink_is_never_followed(tmp_path):
    root, now, elsewhere = tmp_path / "bases", time.time(), tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious").write_bytes(b"p" * 8192)
    base = root / "base-link"
    base.mkdir()
    (base / MODEL).symlink_to(elsewhere, target_is_directory=True)
    (base / HISTORY).write_bytes(b"x" * 8192)
    (base / LAST_USED).touch()
    os.utime(base / LAST_USED, (now - 48 * HOUR,) * 2)
    result = cleanup(root, 0, None, HOUR, now=now)
    assert (elsewhere / "precious").is_file() and (base / MODEL).is_symlink()  # neither followed nor moved
    assert result.evicted == [] and not any("None" in why for why in result.skipped.values())


def test_the_command_survives_a_bug_in_the_cleanup(tmp_path, monkeypatch):
    import orbit_runtime.cache_cleanup as cache_cleanup

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(cache_cleanup, "cleanup", broken)
    message = tmp_path / "termination-log"
    result = CliRunner().invoke(app, ["cache-cleanup", "--root", str(tmp_path), "--max-bytes", "0", "--termination-log", str(message)])
    assert result.exit_code == 0, (result.output, result.exception)  # the job's pod still starts
    assert "did nothing: KeyError" in result.output
    assert json.loads(message.read_text())["cleanup"].startswith("did nothing: KeyError")
