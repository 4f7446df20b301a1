"""The node's base cache: `orbit prepare-base` puts a job's INT4 base into it, once per source content.

A cache directory (the operator names it; the pod's init container sees only it) holds:

    model/          the INT4 base, with its orbit-base.json (content digest): what the roles mount
    model/.orbit-source.json  what it was built from: format, group size, the source's fingerprint
    prepared.json   every preparation: what was done (quantized, copied, verified) and why, how long it took
    last-used       touched by every prepare-base (every pod start): `orbit cache-cleanup`'s LRU clock
    .lock           held while preparing (or evicting), so two pods on one node wait for one writer
    .tmp-*          a copy being written (renamed to model/ when complete; stale ones are removed)
    .old-<t>-*      a base replaced at unix time t because its source changed (removed by cache-cleanup,
                    and by prepare-base once no role holds it and it is RETIRED_GRACE_S old)

Keyed by content: the directory's name says which source (namespace + URI or PVC), and an
existing `model/` is reused only if the fingerprint recorded with it equals the source's current
one (orbit_runtime.base_source: ETags and sizes of the s3:// objects at the resolved endpoint, or
the files' sizes and mtimes of a directory) and it verifies against its digest (stat and
small-file hashes). Otherwise the base is built again; a rebuild that yields the same digest
keeps the existing `model/` (only its fingerprint is updated): nothing is swapped or set aside.
A base from before fingerprints (no record) is rebuilt once: nothing says it matches its
source, and trusting it would stamp a possibly stale base as current for good. When the source
cannot be read for a reason that may pass (S3 unreachable, throttling, a 5xx; the checkpoint
deleted after it was prepared) an existing base is reused as it was, with the reason in the
result: it is what the job used before, and nothing could be built instead. When the source
refuses (AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, NoSuchBucket, no
credentials) prepare-base fails: with those credentials the job may not read that base.

Atomic: the base is written under `.tmp-*` (its fingerprint inside it) and exchanged with
`model/` in one step (orbit_runtime.base_lease.exchange), so a pod killed mid-write leaves no half
base that a later pod would trust. The replaced base is then renamed to `.old-<t>-*`, not deleted:
a running pod of another job bind-mounted the old `model/` (its subPath mount holds the
directory's inode, not its name), so its roles keep reading the old files. A role of that pod
that restarts in place would get the new `model/` (the kubelet resolves the subPath again): it
refuses to start instead (base_lease.check_base_identity, against the digest this command
writes to --base-id), so the pod fails and is replaced rather than run on two bases.

Leases (base_lease.hold_base_lease): every role holds a shared flock on the `model/` it mounted for
as long as it runs; the lock follows the inode through a rename. A `.old-*` is removed (by
cache-cleanup, or here) only when nobody holds it.

Sources: a Hugging Face-format checkpoint (quantized here) or an INT4 base (`orbit quantize`
output, copied and verified), from a directory or an s3:// prefix (credentials from the environment).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from orbit_runtime.base_lease import exchange, unleased
from orbit_runtime.base_source import SourceUnreadable, source_fingerprint
from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.base_digest import MANIFEST, read_base_digest, write_base_manifest

MODEL = "model"
HISTORY = "prepared.json"
LOCK = ".lock"
SOURCE_RECORD = ".orbit-source.json"  # inside model/ (hidden: not part of the base's digest), so it moves with it
LAST_USED = "last-used"
RETIRED_PREFIX = ".old-"
# a `.old-*` younger than this is left to cache-cleanup: a pod whose roles are starting may have mounted it just
# before the swap and not yet taken its lease
RETIRED_GRACE_S = 600.0


@dataclass
class PrepareResult:
    path: str
    digest: str
    action: Literal["quantized", "copied", "verified"]
    seconds: float
    waited_for_lock_s: float
    source: str | None
    format: str
    at: float  # unix time
    reason: str = ""  # why this action: "new", "source unchanged", "source changed", ...

    @property
    def reused(self) -> bool:
        return self.action == "verified"


@contextmanager
def cache_lock(cache: Path, timeout_s: float, shared: bool = False):
    """An flock on CACHE/.lock (exclusive to write; SHARED to only verify, which also works on a
    read-only cache: the file is then opened read-only, and skipped if it does not exist);
    yields the seconds spent waiting for it."""
    started = time.monotonic()
    if shared and not (cache / LOCK).exists():
        yield 0.0
        return
    with open(cache / LOCK, "r" if shared else "a+") as handle:
        while True:
            try:
                fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > timeout_s:
                    raise OrbitError(f"{cache}: another pod has been preparing this base for over {timeout_s:.0f}s") from None
                time.sleep(0.2)
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_source(source: str, scratch: Path) -> Path:
    """A local directory for SOURCE: the directory itself, or an s3:// prefix downloaded into SCRATCH."""
    if not source.startswith("s3://"):
        path = Path(source)
        if not path.is_dir():
            raise OrbitError(f"{source}: the base's source directory does not exist")
        return path
    from orbit_runtime.checkpoint.storage import StorageError, open_store

    try:
        store = open_store(source)
        # the checkpoint's top-level files (not folder markers such as `prefix/`, nor sub-prefixes)
        objects = [o for o in store.list("") if o.key and "/" not in o.key]
        if not objects:
            raise OrbitError(f"{source}: no files under this prefix")
        scratch.mkdir(parents=True, exist_ok=True)
        for obj in objects:
            store.get_file(obj.key, scratch / Path(obj.key).name)
    except StorageError as exc:
        raise OrbitError(f"{source}: cannot download the base ({exc})") from None
    return scratch


def base_model_config(cache: Path, source: str | None) -> dict:
    """The config.json of the base CACHE holds, or of SOURCE before it is prepared (for an s3:// source
    only config.json is downloaded): what `orbit prepare-base --plan` plans the pod with."""
    import tempfile as tmp

    path = Path(cache) / MODEL / "config.json"
    with tmp.TemporaryDirectory(prefix="orbit-config-") as scratch:
        if source is not None and (not path.is_file() or _stale(Path(cache) / MODEL, source)):  # a changed source: its own
            if source.startswith("s3://"):
                from orbit_runtime.checkpoint.storage import StorageError, open_store

                path = Path(scratch) / "config.json"
                try:
                    open_store(source).get_file("config.json", path)
                except StorageError as exc:
                    raise OrbitError(f"{source}: cannot read config.json ({exc})") from None
            else:
                path = Path(source) / "config.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise OrbitError(f"{path}: no config.json to plan the job with") from None
        except ValueError as exc:
            raise OrbitError(f"{path}: not valid JSON ({exc})") from None


def _stale(model: Path, source: str) -> bool:
    """Whether the base in MODEL was built from other content than SOURCE has now (unknown: not stale)."""
    try:
        return (_recorded(model) or {}).get("source") != source_fingerprint(source)
    except OrbitError:
        return False


def _copy_int4(src: Path, dst: Path) -> None:
    """Copy an INT4 base's regular top-level files, then make sure its digest describes the copy."""
    from orbit_runtime.int4.schemes import read_quantization_config

    config = src / "config.json"
    if not config.is_file():
        raise OrbitError(f"{src}: not a model directory (no config.json)")
    read_quantization_config(json.loads(config.read_text()), str(config))  # OrbitError if it is not INT4
    dst.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            shutil.copy2(path, dst / path.name)
    if (dst / MANIFEST).is_file():
        read_base_digest(dst, verify="full")  # the copy is what was recorded
    else:
        write_base_manifest(dst)


def _record(cache: Path, result: PrepareResult) -> None:
    path = cache / HISTORY
    try:
        history = json.loads(path.read_text()) if path.is_file() else []
    except ValueError:
        history = []
    history.append({**asdict(result), "reused": result.reused})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(history, indent=2))
    os.replace(tmp, path)


def build_record(fmt: str, source: str, group_size: int) -> dict:
    """What a base of SOURCE prepared with FMT (and GROUP_SIZE, for hf) is built from; OrbitError if
    the source cannot be read."""
    return {"format": fmt, "groupSize": group_size if fmt == "hf" else None, "source": source_fingerprint(source)}


def _recorded(model: Path) -> dict | None:
    try:
        return json.loads((model / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _build(cache: Path, fmt: Literal["hf", "int4"], source: str, group_size: int, wanted: dict) -> tuple[str, str, bool]:
    """Build the base of SOURCE under .tmp-* and swap it in as CACHE/model (the old one renamed to .old-*),
    unless it has the digest of the base already there: that one then stays, with the new fingerprint.
    (action, digest, whether model/ was replaced)."""
    model = cache / MODEL
    scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache))
    try:
        src = _fetch_source(source, scratch / "download")
        staging = scratch / MODEL
        if fmt == "hf":
            from orbit_runtime.int4.quantize import quantize_checkpoint
            from orbit_runtime.int4.schemes import W4A16Int

            quantize_checkpoint(src, staging, W4A16Int(group_size=group_size))
            action = "quantized"
        else:
            _copy_int4(src, staging)
            action = "copied"
        digest = read_base_digest(staging, verify="quick")
        if build_record(fmt, source, group_size) != wanted:  # one more listing: the base is what the record says
            raise OrbitError(f"{source}: the source changed while the base was being prepared; the next attempt prepares it again")
        if _current_digest(model) == digest:  # the same base (a re-upload of the same bytes, a legacy base): no swap
            _write_record(model, wanted)
            return action, digest, False
        _write_record(staging, wanted)
        if not model.exists():
            os.rename(staging, model)  # atomic: model/ appears complete or not at all
        else:  # the old one aside, not deleted: running pods of other jobs still read it (module docstring)
            retired = cache / f"{RETIRED_PREFIX}{int(time.time())}-{secrets.token_hex(4)}"
            if exchange(staging, model):  # one step: model/ is never missing
                os.rename(staging, retired)
            else:
                os.rename(model, retired)
                os.rename(staging, model)
        dir_fd = os.open(cache, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return action, digest, True


def _current_digest(model: Path) -> str | None:
    """The digest of the base in MODEL if it is intact (quick verification), else None."""
    if model.is_symlink() or not (model / MANIFEST).is_file():
        return None
    try:
        return read_base_digest(model, verify="quick")
    except OrbitError:
        return None


def _write_record(model: Path, record: dict) -> None:
    """What MODEL was built from (SOURCE_RECORD, hidden: not part of the base's digest), replaced atomically."""
    tmp = model / f"{SOURCE_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, model / SOURCE_RECORD)


def _remove_retired(cache: Path, now: float) -> list[str]:
    """Remove CACHE's `.old-*` copies that no role holds and that were set aside over RETIRED_GRACE_S ago
    (so they do not pile up when no cache limit is set); the names removed. Called under the lock."""
    removed = []
    for old in sorted(cache.glob(f"{RETIRED_PREFIX}*")):
        if old.is_symlink() or not old.is_dir() or now - retired_time(old) < RETIRED_GRACE_S:
            continue
        try:
            fd = unleased(old)
        except OSError:
            continue
        if fd is None:
            continue  # a running pod's role still reads it
        try:
            shutil.rmtree(old)
            removed.append(old.name)
        except OSError:
            pass  # cache-cleanup tries again
        finally:
            os.close(fd)
    return removed


def retired_time(old: Path) -> float:
    """The unix time in a `.old-<t>-<random>` name, else its mtime."""
    stamp = old.name[len(RETIRED_PREFIX) :].split("-", 1)[0]
    if stamp.isdigit():
        return float(stamp)
    try:
        return old.stat().st_mtime
    except OSError:
        return time.time()


def prepare_base(cache: Path, fmt: Literal["hf", "int4"], source: str | None, group_size: int = 128,
                 lock_timeout_s: float = 6 * 3600) -> PrepareResult:  # fmt: skip
    """Make CACHE/model the verified INT4 base of SOURCE's current content (see the module docstring)."""
    cache = Path(cache)
    if not cache.is_dir():
        raise OrbitError(f"{cache}: the cache directory does not exist (the pod mounts it)")
    model = cache / MODEL
    started = time.monotonic()
    if source is None:  # an administrator's base (mounted read-only): verify, write nothing
        with cache_lock(cache, lock_timeout_s, shared=True) as waited:
            if not (model / MANIFEST).is_file():
                raise OrbitError(f"{model}: no base here, and no source to build it from (a nodeCache base is placed by an administrator)")
            digest = read_base_digest(model, verify="quick")
        return PrepareResult(str(model), digest, "verified", round(time.monotonic() - started, 3), round(waited, 3), None, fmt,
                             time.time(), "an administrator's base")  # fmt: skip
    try:
        with cache_lock(cache, lock_timeout_s) as waited:
            for stale in cache.glob(".tmp-*"):  # left by a pod killed mid-write (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            (cache / LAST_USED).touch()  # cache-cleanup's LRU clock (under the lock: it re-reads it under the lock too)
            if model.is_symlink():
                raise OrbitError(f"{model}: a symbolic link (not written by prepare-base); remove it")
            if model.is_dir() and not any(model.iterdir()):
                model.rmdir()  # the kubelet's empty mount point: a role restarted in place after cache-cleanup evicted it
            try:
                wanted, unreadable = build_record(fmt, source, group_size), None
            except SourceUnreadable as exc:
                if not exc.reusable:  # refused (credentials, endpoint, bucket): the base here may be another source's
                    raise
                wanted, unreadable = None, str(exc)
            action: Literal["quantized", "copied", "verified"] = "verified"
            if (model / MANIFEST).is_file():
                recorded, reuse = _recorded(model), False
                if wanted is None:
                    reason, reuse = f"source not checked ({unreadable}): reused the base prepared from it before", True
                elif recorded == wanted:
                    reason, reuse = "source unchanged", True
                elif recorded is None:
                    reason = "no source fingerprint recorded (a base from before fingerprints): rebuilt once"
                elif recorded.get("source") != wanted["source"]:
                    reason = f"source changed: {_change(recorded, wanted)}"
                else:
                    reason = "format or group size changed"
                if reuse:
                    digest = read_base_digest(model, verify="quick")
                else:
                    action, digest, swapped = _build(cache, fmt, source, group_size, wanted)  # type: ignore[arg-type]
                    reason += "" if swapped else "; the same base as before (same digest): kept in place"
            else:
                if model.exists():
                    raise OrbitError(f"{model}: a base without {MANIFEST} (not written by prepare-base); remove it")
                if wanted is None:
                    raise OrbitError(unreadable)
                reason = "new"
                action, digest, _ = _build(cache, fmt, source, group_size, wanted)  # type: ignore[assignment]
            if removed := _remove_retired(cache, time.time()):
                reason += f"; removed {len(removed)} replaced base(s) no pod uses"
            result = PrepareResult(str(model), digest, action, round(time.monotonic() - started, 3), round(waited, 3),
                                   source, fmt, time.time(), reason)  # fmt: skip
            _record(cache, result)
            return result
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OrbitError(f"{cache}: disk full while preparing the base ({exc.filename or ''}); free space on the node") from None
        if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise OrbitError(f"{cache}: cannot write the cache ({exc.strerror}: {exc.filename}); the cache root must be "
                             "writable by the pod's user") from None  # fmt: skip
        raise


def _change(recorded: dict, wanted: dict) -> str:
    """In words, what differs between two source fingerprints (for the prepare result)."""
    old, new = recorded.get("source") or {}, wanted["source"]
    if old.get("endpoint") != new.get("endpoint"):
        return f"endpoint changed (its hash {old.get('endpoint')} -> {new.get('endpoint')})"
    entries = "objects" if new["kind"] == "s3" else "files"
    before, after = {e[0]: e for e in old.get(entries) or []}, {e[0]: e for e in new.get(entries) or []}
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return f"{len(changed)} file(s) differ ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})"
