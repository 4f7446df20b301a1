"""`orbit cache-cleanup`: keep the node's base cache under a size limit, least recently used first.

An init container of every job pod when the operator sets a limit (ORBIT_CACHE_MAX_GIB), before
prepare-base; it mounts the whole cache root (prepare-base sees only its own directory) and
needs no Secret and no network. What it may remove, in this order:

1. `<base>/.old-<t>-*`: bases replaced because their source changed (orbit_runtime.base_cache).
   No new pod mounts them, so they go whenever they qualify, even under the limit.
2. `<base>/model` of `base-*` directories, least recently used first (the `last-used` stamp
   prepare-base touches on every pod start; for a base without one, the mtime of its
   `prepared.json`, which prepare-base before stamps rewrote at every pod start, then its
   model's), until the total is under the limit. A base is sized by its `model/` (what eviction
   frees); the rest of its directory (bookkeeping, a `.tmp-*` being written) is counted, never
   evicted, and a base without a `model/` (evicted before) is not a candidate.

Never: the directory it is told to keep (the pod's own base; its `.old-*` do qualify), anything
under `named/` (an administrator's bases), anything that is not a `base-*` directory, a base used
more recently than the idle limit, a base being prepared (its `.lock` is taken exclusively with a
non-blocking try; busy means skip), and a base or `.old-*` a running role holds its lease on (a
shared flock on the directory, `base_lease.hold_base_lease`). An evicted base keeps its directory
(lock, history, stamp): a pod waiting for its lock, or already holding a subPath mount of it, then
simply prepares it again.

Deciding what to evict is `plan_evictions`, a pure function; the rest is a thin layer of I/O.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from orbit_runtime.base_cache import HISTORY, LAST_USED, LOCK, MODEL, RETIRED_PREFIX, retired_time
from orbit_runtime.base_lease import try_flock
from orbit_runtime.errors import OrbitError

NAMED = "named"
BASE_PREFIX = "base-"


@dataclass(frozen=True)
class Entry:
    """One removable thing: a base's model (path `base-x`) or a replaced copy (`base-x/.old-...`)."""

    path: str  # relative to the cache root
    base: str  # the base directory it belongs to
    size: int  # bytes on disk
    last_used: float  # unix time: the base's last pod start, or when a .old-* was replaced
    retired: bool = False  # a `.old-*` copy
    pinned: str | None = None  # why it is never evicted (an administrator's base, in use, ...)


@dataclass
class CleanupResult:
    root: str
    limit_bytes: int
    total_bytes: int  # before
    remaining_bytes: int
    freed_bytes: int = 0
    evicted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # a candidate it could not evict, and why

    @property
    def over_limit(self) -> bool:
        return self.remaining_bytes > self.limit_bytes

    def summary(self) -> str:
        """One line: the operator's event and the container's log."""
        gib = 1 << 30
        line = f"cache {self.remaining_bytes / gib:.1f} GiB of {self.limit_bytes / gib:.1f} GiB"
        line += f"; evicted {len(self.evicted)} ({self.freed_bytes / gib:.1f} GiB freed{': ' if self.evicted else ''}"
        line += ", ".join(self.evicted[:5]) + (", ..." if len(self.evicted) > 5 else "") + ")"
        if self.skipped:
            line += "; skipped " + ", ".join(f"{k} ({v})" for k, v in list(self.skipped.items())[:5])
        return line + ("; still over the limit" if self.over_limit else "")


def plan_evictions(entries: list[Entry], max_bytes: int, keep: str, min_idle_s: float, now: float) -> list[Entry]:
    """What to evict, in order: every qualifying `.old-*` (oldest first), then qualifying bases least
    recently used first while the total of ENTRIES is over MAX_BYTES. Pinned entries, KEEP's base and
    anything used within MIN_IDLE_S of NOW never qualify (KEEP's `.old-*` do)."""
    idle = [e for e in entries if e.pinned is None and e.size > 0 and now - e.last_used >= min_idle_s]
    free = [e for e in idle if e.retired or e.base != keep]
    plan = sorted((e for e in free if e.retired), key=lambda e: (e.last_used, e.path))
    total = sum(e.size for e in entries) - sum(e.size for e in plan)
    for entry in sorted((e for e in free if not e.retired), key=lambda e: (e.last_used, e.path)):
        if total <= max_bytes:
            break
        plan.append(entry)
        total -= entry.size
    return plan


def cleanup(root: Path, max_bytes: int, keep: str | None, min_idle_s: float, now: float | None = None) -> CleanupResult:
    """Evict from the cache at ROOT what `plan_evictions` chooses; what cannot be evicted now is
    pinned (with the reason) and the plan made again, so the next candidate takes its place."""
    root = Path(root)
    if not root.is_dir():
        raise OrbitError(f"{root}: the cache root does not exist (the pod mounts it)")
    if max_bytes < 0 or min_idle_s < 0:
        raise OrbitError(f"--max-bytes and --min-idle-seconds must be >= 0, got {max_bytes} and {min_idle_s}")
    now = time.time() if now is None else now
    entries = scan(root)
    total = sum(e.size for e in entries)
    result = CleanupResult(str(root), max_bytes, total, total)
    while plan := plan_evictions(entries, max_bytes, keep or "", min_idle_s, now):
        entry = plan[0]
        entries.remove(entry)
        why = _evict(root, entry, min_idle_s)
        if why is None:
            result.evicted.append(entry.path)
            result.freed_bytes += entry.size
        else:
            result.skipped[entry.path] = why
            entries.append(replace(entry, pinned=why))
    result.remaining_bytes = total - result.freed_bytes
    return result


def scan(root: Path) -> list[Entry]:
    """Every base under ROOT, its `.old-*` copies, and whatever else is there (pinned: counted, never removed)."""
    entries = []
    for item in sorted(root.iterdir()):
        if item.is_symlink() or not item.is_dir():
            continue
        if item.name == NAMED:
            entries += [Entry(f"{NAMED}/{n.name}", f"{NAMED}/{n.name}", disk_usage(n), _mtime(n), pinned="an administrator's base")
                        for n in sorted(item.iterdir()) if n.is_dir() and not n.is_symlink()]  # fmt: skip
            continue
        if not item.name.startswith(BASE_PREFIX):
            entries.append(Entry(item.name, item.name, disk_usage(item), _mtime(item), pinned="not a base directory"))
            continue
        retired = [c for c in sorted(item.iterdir()) if c.name.startswith(RETIRED_PREFIX) and c.is_dir() and not c.is_symlink()]
        for old in retired:
            entries.append(Entry(f"{item.name}/{old.name}", item.name, disk_usage(old), retired_time(old), retired=True))
        model = item / MODEL
        size = disk_usage(model) if _real_dir(model) else 0
        rest = disk_usage(item) - size - sum(e.size for e in entries if e.retired and e.base == item.name)
        if size:  # what evicting the base frees; none: evicted already (or never built), nothing to plan
            entries.append(Entry(item.name, item.name, size, last_used(item)))
        if rest > 0:  # its lock, stamps, history, a copy being written: counted, never removed here
            entries.append(Entry(f"{item.name}/*", item.name, rest, last_used(item), pinned="the base's other files"))
    return entries


def _real_dir(path: Path) -> bool:
    """PATH is a directory, not a symbolic link to one (never followed: it could point anywhere on the node)."""
    return path.is_dir() and not path.is_symlink()


def last_used(base: Path) -> float:
    """When a pod last started on BASE: its `last-used` stamp; for a base from before stamps, the mtime of its
    prepared.json (rewritten at every pod start by the prepare-base of then), else its model's (or its own)."""
    for path in (base / LAST_USED, base / HISTORY, base / MODEL, base):
        try:
            return path.stat().st_mtime
        except OSError:
            continue
    return 0.0


def disk_usage(path: Path) -> int:
    """Bytes PATH takes on disk (allocated blocks; symlinks not followed)."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _evict(root: Path, entry: Entry, min_idle_s: float) -> str | None:
    """Remove ENTRY, checking again under the locks; None when done, else why it was left."""
    base = root / entry.base
    try:
        if entry.retired:
            lease = try_flock(root / entry.path, os.O_RDONLY | os.O_DIRECTORY)
            if lease is None:
                return "in use by a running pod"
            try:
                shutil.rmtree(root / entry.path)
            finally:
                os.close(lease)
            return None
        lock = try_flock(base / LOCK, os.O_RDWR | os.O_CREAT)
        if lock is None:
            return "being prepared"
        try:
            if time.time() - last_used(base) < min_idle_s:
                return "used recently"  # a pod started on it since the scan
            for stale in base.glob(".tmp-*"):  # a dead writer's (we hold the lock: no writer is alive)
                shutil.rmtree(stale, ignore_errors=True)
            model = base / MODEL
            if not _real_dir(model):
                return None  # gone since the scan (another pod's cleanup evicted it)
            lease = try_flock(model, os.O_RDONLY | os.O_DIRECTORY)
            if lease is None:
                return "in use by a running pod"
            try:
                doomed = base / f".tmp-evicted-{secrets.token_hex(4)}"  # prepare-base removes a .tmp-* left half-deleted
                os.rename(model, doomed)
            finally:
                os.close(lease)
            shutil.rmtree(doomed)
            return None
        finally:
            os.close(lock)
    except OSError as exc:
        return f"cannot remove: {exc.strerror or exc}"
