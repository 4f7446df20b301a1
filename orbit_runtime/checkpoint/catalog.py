"""Checkpoints on an object store: layout, atomic commit, verification, retention.

    <uri>/step-00000012/adapter/adapter_config.json      PEFT adapter, loadable as is by
    <uri>/step-00000012/adapter/adapter_model.safetensors vLLM and transformers + peft
    <uri>/step-00000012/trainer_state.pt                  optimizer, LR scheduler, RNG states
    <uri>/step-00000012/state.json                        step, adapter version, data cursor, config
    <uri>/step-00000012/metrics.jsonl                     the curves so far
    <uri>/step-00000012/MANIFEST.json                     written LAST: sizes + sha256 of all the above

A checkpoint exists only once its manifest does: every file is uploaded first, the manifest
last. A step directory without a manifest (or whose objects do not match it) is torn - a
writer died or storage failed mid-upload - and is never read; the writer cleans it up.
Deletion removes the manifest first, so a half-deleted checkpoint is torn, never "complete".
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from orbit_runtime.checkpoint.storage import ObjectNotFound, ObjectStore, StorageError, sha256_file

MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CorruptCheckpoint(StorageError):
    """A checkpoint's objects do not match its manifest."""


def step_dir(step: int) -> str:
    """The directory name of checkpoint STEP (the one place that names it)."""
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """`step-00000012` -> 12; None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class CheckpointEntry:
    """One step directory under the checkpoint URI."""

    step: int
    uri: str
    complete: bool
    manifest: dict | None = None
    sizes: dict[str, int] = field(default_factory=dict)  # relative path -> size, as listed

    @property
    def config_hash(self) -> str | None:
        return self.manifest.get("config_hash") if self.manifest else None

    @property
    def score(self) -> float | None:
        return self.manifest.get("score") if self.manifest else None

    def to_json(self) -> dict:
        manifest = self.manifest or {}
        return {
            "step": self.step,
            "uri": self.uri,
            "complete": self.complete,
            "adapter_version": manifest.get("adapter_version"),
            "config_hash": manifest.get("config_hash"),
            "score": manifest.get("score"),
            "created": manifest.get("created"),
            "bytes": sum(self.sizes.values()),
        }


def plan_retention(entries: list[CheckpointEntry], keep_last: int, keep_best: int) -> list[CheckpointEntry]:
    """Complete checkpoints to delete: all but the last KEEP_LAST by step and the best KEEP_BEST by score."""
    complete = sorted((e for e in entries if e.complete), key=lambda e: e.step)
    keep = {e.step for e in complete[-keep_last:]} if keep_last > 0 else set()
    scored = [e for e in complete if e.score is not None]
    # highest score first; among equal scores the later checkpoint wins
    keep |= {e.step for e in sorted(scored, key=lambda e: (e.score, e.step), reverse=True)[:keep_best]}
    return [e for e in complete if e.step not in keep]


class CheckpointCatalog:
    """Reads and writes checkpoints under one store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @property
    def uri(self) -> str:
        return self.store.uri

    def entry_uri(self, step: int) -> str:
        return f"{self.store.uri}/{step_dir(step)}"

    # ---- writing -------------------------------------------------------------------------
    def write(self, step: int, local_dir: Path, meta: dict) -> CheckpointEntry:
        """Upload LOCAL_DIR as checkpoint STEP: all files, then the manifest. Returns the entry."""
        local_dir = Path(local_dir)
        files = {}
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            rel = path.relative_to(local_dir).as_posix()
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        prefix = step_dir(step)
        for rel in files:
            self.store.put_file(f"{prefix}/{rel}", local_dir / rel)
        manifest = {"format": FORMAT_VERSION, "step": step, "created": time.time(), **meta, "files": files}
        self.store.put_bytes(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
        sizes = {rel: info["size"] for rel, info in files.items()}
        return CheckpointEntry(step, self.entry_uri(step), True, manifest, sizes)

    def delete(self, entry: CheckpointEntry) -> None:
        """Remove a checkpoint, manifest first (so no reader ever sees it half-deleted as complete)."""
        prefix = step_dir(entry.step)
        keys = [o.key for o in self.store.list(f"{prefix}/")]
        manifest_key = f"{prefix}/{MANIFEST}"
        if manifest_key in keys:
            self.store.delete([manifest_key])
        self.store.delete([k for k in keys if k != manifest_key])

    # ---- reading -------------------------------------------------------------------------
    def entries(self) -> list[CheckpointEntry]:
        """Every step directory, sorted by step; `complete` only if the manifest matches the listing."""
        by_step: dict[int, dict[str, int]] = {}
        for obj in self.store.list():
            head, _, rest = obj.key.partition("/")
            step = parse_step_dir(head)
            if step is not None and rest:
                by_step.setdefault(step, {})[rest] = obj.size
        out = []
        for step in sorted(by_step):
            listed = by_step[step]
            manifest = None
            if MANIFEST in listed:
                try:
                    manifest = json.loads(self.store.get_bytes(f"{step_dir(step)}/{MANIFEST}"))
                except (ObjectNotFound, ValueError):
                    manifest = None
            sizes = {k: v for k, v in listed.items() if k != MANIFEST}
            complete = manifest is not None and all(
                sizes.get(rel) == info.get("size") for rel, info in manifest.get("files", {}).items()
            )
            out.append(CheckpointEntry(step, self.entry_uri(step), complete, manifest, sizes))
        return out

    def complete(self) -> list[CheckpointEntry]:
        return [e for e in self.entries() if e.complete]

    def get(self, step: int) -> CheckpointEntry:
        for entry in self.entries():
            if entry.step == step:
                return entry
        raise ObjectNotFound(f"{self.entry_uri(step)}: no such checkpoint")

    def download(self, entry: CheckpointEntry, dest: Path, only: str = "") -> Path:
        """Fetch ENTRY's files (those under ONLY, if given) into DEST, verifying size and sha256."""
        if not entry.complete:
            raise CorruptCheckpoint(f"{entry.uri}: incomplete (no matching manifest); it cannot be used")
        dest = Path(dest)
        for rel, info in entry.manifest["files"].items():
            if not rel.startswith(only):
                continue
            target = dest / rel[len(only) :].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            self.store.get_file(f"{step_dir(entry.step)}/{rel}", target)
            if target.stat().st_size != info["size"] or sha256_file(target) != info["sha256"]:
                raise CorruptCheckpoint(f"{entry.uri}/{rel}: content does not match the manifest's checksum")
        return dest

    def download_to_temp(self, entry: CheckpointEntry) -> Path:
        return self.download(entry, Path(tempfile.mkdtemp(prefix=f"orbit-{step_dir(entry.step)}-")))

    # ---- housekeeping ----------------------------------------------------------------------
    def remove_torn(self) -> list[CheckpointEntry]:
        """Delete step directories that never completed; returns what was removed."""
        torn = [e for e in self.entries() if not e.complete]
        for entry in torn:
            self.delete(entry)
        return torn

    def clean(self, keep_last: int, keep_best: int) -> list[CheckpointEntry]:
        """Retention plus torn-directory removal, from one listing; returns what was removed."""
        entries = self.entries()
        doomed = plan_retention(entries, keep_last, keep_best) + [e for e in entries if not e.complete]
        for entry in doomed:
            self.delete(entry)
        return doomed
