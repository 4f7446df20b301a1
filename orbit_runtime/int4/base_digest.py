"""The base's identity: a sha256 digest of its content, recorded once in its manifest.

`orbit quantize` writes MANIFEST (orbit-base.json) into the INT4 directory as its last file:
each file's size and sha256, and the digest over all of them. A run reads the digest back
(cheaply: the file list and sizes, and the hash of the small files) and puts it in the config
hash, so a checkpoint is resumed only onto the base it was trained on, wherever that base
lives, and never onto a different base rebuilt at the same path.

The files that count are the regular, non-hidden files at the top of the directory (weights,
config.json, the shard index, tokenizer files, generation config, chat template): all of
them decide what the model computes. Hidden files (.gitattributes, .cache/) and
subdirectories are not read by the engines and are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Literal

from orbit_runtime.errors import OrbitError

MANIFEST = "orbit-base.json"
FORMAT = "orbit-base/1"
CHUNK = 1 << 20  # bytes read at a time while hashing
# Quick verification re-hashes every file except the weight shards up to this size
# (config, index, tokenizer, generation config: kilobytes to tens of MiB).
QUICK_HASH_LIMIT = 64 << 20
# How to record a base's current content when the change is intended.
RECORD_COMMAND = "python -m orbit_runtime.int4.base_digest {dir} --write"

logger = logging.getLogger(__name__)


def base_files(base_dir: Path) -> list[Path]:
    """The files whose content defines the base, sorted by name (MANIFEST excluded)."""
    return sorted(
        (p for p in Path(base_dir).iterdir() if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST),
        key=lambda p: p.name,
    )


def file_sha256(path: Path) -> str:
    """Hex sha256 of PATH, read in CHUNK-sized pieces (memory stays flat for any file size)."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def digest_of(files: dict[str, dict]) -> str:
    """`sha256:<hex>` over the sorted (name, sha256) pairs of FILES."""
    pairs = sorted([name, entry["sha256"]] for name, entry in files.items())
    return "sha256:" + hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()


def compute_base_manifest(base_dir: Path) -> dict:
    """The manifest of BASE_DIR as it is now (hashes every file)."""
    base_dir = _check_dir(base_dir)
    files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in base_files(base_dir)}
    if not files:
        raise OrbitError(f"{base_dir}: empty directory, not a model")
    return {"format": FORMAT, "digest": digest_of(files), "files": files}


def write_base_manifest(base_dir: Path) -> str:
    """Hash BASE_DIR, write its MANIFEST (replacing any), and return the digest."""
    base_dir = _check_dir(base_dir)
    manifest = compute_base_manifest(base_dir)
    tmp = base_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, base_dir / MANIFEST)
    return manifest["digest"]


def read_base_digest(base_dir: Path, verify: Literal["quick", "full"] = "quick") -> str:
    """The digest of the base in BASE_DIR, checked against the directory.

    quick: the files and their sizes are those of the manifest (stat only), and the files
    other than the weight shards (up to QUICK_HASH_LIMIT) still have their recorded sha256.
    full: every file is hashed again. A mismatch raises OrbitError naming the files.
    Without a manifest (a base from an older Orbit or another tool) the digest is computed
    from all files and returned; nothing is written into BASE_DIR (it may be read-only).
    """
    base_dir = _check_dir(base_dir)
    path = base_dir / MANIFEST
    if not path.is_file():
        started = time.monotonic()
        manifest = compute_base_manifest(base_dir)
        size = sum(entry["size"] for entry in manifest["files"].values())
        logger.warning(
            "%s: no %s (quantized by an older Orbit or another tool); computed the base digest by hashing %d files "
            "(%.1f GiB in %.1fs). Record it once with `%s` (or `orbit quantize`) where the base is writable.",
            base_dir, MANIFEST, len(manifest["files"]), size / 2**30, time.monotonic() - started,
            RECORD_COMMAND.format(dir=base_dir),
        )  # fmt: skip
        return manifest["digest"]

    manifest = _load_manifest(path)
    recorded: dict[str, dict] = manifest["files"]
    present = {p.name: p for p in base_files(base_dir)}
    problems = [f"{name} was removed" for name in sorted(set(recorded) - set(present))]
    problems += [f"{name} was added" for name in sorted(set(present) - set(recorded))]
    for name in sorted(set(recorded) & set(present)):
        size = present[name].stat().st_size
        if size != recorded[name]["size"]:
            problems.append(f"{name} is {size} bytes, {recorded[name]['size']} when recorded")
        elif _rehash(name, size, verify) and file_sha256(present[name]) != recorded[name]["sha256"]:
            problems.append(f"{name} has other content (same size)")
    if problems:
        shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
        raise OrbitError(
            f"{base_dir}: the base changed after `orbit quantize` wrote {MANIFEST}:\n  " + "\n  ".join(shown) + "\n"
            f"Its recorded digest ({manifest['digest']}) no longer describes it. Rebuild it with `orbit quantize SRC "
            f"{base_dir} --overwrite`, or, if the change is intended, record the new content with "
            f"`{RECORD_COMMAND.format(dir=base_dir)}` (checkpoints trained on the old content are then resumed only "
            "with --resume-from)."
        )
    return manifest["digest"]


def _rehash(name: str, size: int, verify: str) -> bool:
    if verify == "full":
        return True
    if verify != "quick":
        raise ValueError(f"verify must be 'quick' or 'full', not {verify!r}")
    return not name.endswith(".safetensors") and size <= QUICK_HASH_LIMIT


def _check_dir(base_dir: Path) -> Path:
    base_dir = Path(base_dir)
    if not base_dir.is_dir():
        raise OrbitError(f"{base_dir}: not a directory (model.path must be an `orbit quantize` output directory)")
    return base_dir


def _load_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise OrbitError(
            f"{path}: unreadable base manifest ({exc}); delete it or rewrite it with `{RECORD_COMMAND.format(dir=path.parent)}`"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise OrbitError(f"{path}: base manifest format {found!r}, expected {FORMAT!r} (written by another Orbit version?)")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(e, dict) and {"size", "sha256"} <= set(e) for e in files.values()):
        raise OrbitError(f"{path}: base manifest without a valid file list")
    if manifest.get("digest") != digest_of(files):
        raise OrbitError(
            f"{path}: the digest does not match the file list (edited by hand?); "
            f"rewrite it with `{RECORD_COMMAND.format(dir=path.parent)}`"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orbit_runtime.int4.base_digest",
        description=f"Print the content digest of an INT4 base directory (from its {MANIFEST}, verified).",
    )
    parser.add_argument("dir", type=Path)
    parser.add_argument("--write", action="store_true", help=f"hash every file and (re)write {MANIFEST}")
    parser.add_argument("--full", action="store_true", help="verify by hashing every file (default: sizes + small files)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        digest = write_base_manifest(args.dir) if args.write else read_base_digest(args.dir, "full" if args.full else "quick")
    except OrbitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
