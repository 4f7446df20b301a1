"""The node's base cache: `orbit prepare-base` puts a job's INT4 base into it, once.

A cache directory (the operator names it; the pod's init container sees only it) holds:

    model/          the INT4 base, with its orbit-base.json (content digest): what the roles mount
    prepared.json   every preparation: what was done (quantized, copied, verified), how long it took
    .lock           held while preparing, so two pods on one node wait for one writer
    .tmp-*          a copy being written (renamed to model/ when complete; stale ones are removed)

Idempotent: an existing complete `model/` is verified against its digest (stat and small-file
hashes), never rebuilt. Atomic: the base is written under `.tmp-*` and renamed into place, so a
pod killed mid-write leaves no half base that a later pod would trust. Sources: a Hugging
Face-format checkpoint (quantized here) or an INT4 base (`orbit quantize` output, copied and
verified), from a directory or an s3:// prefix (credentials from the environment).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.base_digest import MANIFEST, read_base_digest, write_base_manifest

MODEL = "model"
HISTORY = "prepared.json"
LOCK = ".lock"


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
        if not path.is_file() and source is not None:
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


def prepare_base(cache: Path, fmt: Literal["hf", "int4"], source: str | None, group_size: int = 128,
                 lock_timeout_s: float = 6 * 3600) -> PrepareResult:  # fmt: skip
    """Make CACHE/model the verified INT4 base of SOURCE (see the module docstring)."""
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
                             time.time())  # fmt: skip
    try:
        with cache_lock(cache, lock_timeout_s) as waited:
            for stale in cache.glob(".tmp-*"):  # left by a pod killed mid-write (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            if (model / MANIFEST).is_file():
                action: Literal["quantized", "copied", "verified"] = "verified"
                digest = read_base_digest(model, verify="quick")
            else:
                if model.exists():
                    raise OrbitError(f"{model}: a base without {MANIFEST} (not written by prepare-base); remove it")
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
                    os.rename(staging, model)  # atomic: model/ appears complete or not at all
                    dir_fd = os.open(cache, os.O_RDONLY)
                    try:
                        os.fsync(dir_fd)
                    finally:
                        os.close(dir_fd)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
            result = PrepareResult(str(model), digest, action, round(time.monotonic() - started, 3), round(waited, 3),
                                   source, fmt, time.time())  # fmt: skip
            _record(cache, result)
            return result
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OrbitError(f"{cache}: disk full while preparing the base ({exc.filename or ''}); free space on the node") from None
        if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise OrbitError(f"{cache}: cannot write the cache ({exc.strerror}: {exc.filename}); the cache root must be "
                             "writable by the pod's user") from None  # fmt: skip
        raise
