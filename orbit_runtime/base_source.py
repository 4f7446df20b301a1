"""What a cached base was built from: a fingerprint of its source, so that prepare-base reuses a
base only while its source is unchanged.

The node cache's directory names come from the job's spec (namespace + source URI or PVC), not
from the source's content: a checkpoint re-uploaded to the same prefix, or the same `s3://` URI
behind another endpoint, has the same directory. The fingerprint is what tells them apart:

- an `s3://` prefix: a hash of the endpoint boto3 resolved (AWS_ENDPOINT_URL, the region's AWS
  endpoint; hashed, not redacted: the endpoint may come from the base's Secret, every value of
  which prepare-base masks, and two masked endpoints would look equal), the bucket and prefix,
  and every top-level object's (key, ETag, size), from one ListObjectsV2 pass. A re-upload
  changes the ETag (for a multipart upload it depends on the part size too, so re-uploading
  identical bytes differently rebuilds once: the conservative side).
- a directory (a PVC): every top-level file's (name, size, mtime_ns, ctime_ns). This is a
  METADATA fingerprint, not a hash of the checkpoint's bytes (which can be terabytes); the ctime
  (which no user can set) also sees a rewrite that keeps the size and restores the mtime. A
  copy or restore of the same bytes to the volume changes it too: rebuilt once, the safe side.

A source that cannot be read raises SourceUnreadable; `reusable` says whether the base prepared
from it before may still be used (a transient S3 failure, a checkpoint deleted once prepared) or
not (credentials refused, no such bucket: the base may be another endpoint's or tenant's).

The files counted are the ones prepare-base reads: regular, non-hidden, top-level (the same
rule as the base's own digest, orbit_runtime.int4.base_digest). No credentials are in it: it is
written next to the base, which every role can read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from orbit_runtime.errors import OrbitError


class SourceUnreadable(OrbitError):
    """The source could not be read; REUSABLE: whether a base prepared from it before may still be used."""

    def __init__(self, message: str, reusable: bool) -> None:
        super().__init__(message)
        self.reusable = reusable


def source_fingerprint(source: str) -> dict:
    """The fingerprint of SOURCE (an s3:// prefix or a directory); SourceUnreadable if it cannot be read."""
    if source.startswith("s3://"):
        return _s3_fingerprint(source)
    path = Path(source)
    if not path.is_dir():
        raise SourceUnreadable(f"{source}: the base's source directory does not exist", reusable=True)
    files = []
    for item in sorted(path.iterdir(), key=lambda p: p.name):
        if item.name.startswith(".") or not item.is_file():
            continue
        stat = item.stat()
        files.append([item.name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns])
    return {"kind": "directory", "path": str(path), "files": files}


def _s3_fingerprint(source: str) -> dict:
    from orbit_runtime.checkpoint.storage import S3Store, StorageError, open_store

    try:
        store = open_store(source)
        assert isinstance(store, S3Store)
        objects = [[o.key, o.etag, o.size] for o in store.list("") if _counted(o.key)]
        endpoint = endpoint_id(store.endpoint)
    except StorageError as exc:
        if exc.transient:
            raise SourceUnreadable(f"{source}: cannot list the base's source ({exc})", reusable=True) from None
        raise SourceUnreadable(f"{source}: the base's source refused the listing ({exc}); check the base's "
                               "credentialsSecret (its credentials and endpoint) and the URI", reusable=False) from None  # fmt: skip
    if not objects:
        raise SourceUnreadable(f"{source}: no files under this prefix", reusable=True)
    return {"kind": "s3", "endpoint": endpoint, "uri": store.uri, "objects": sorted(objects)}


def endpoint_id(url: str) -> str:
    """What the fingerprint records of an endpoint URL: 16 hex characters of its sha256 (it may be secret, and
    may carry user:password@), so that two endpoints differ in the record without either being written."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def _counted(key: str) -> bool:
    """A top-level, non-hidden object (not a folder marker such as `prefix/`, nor under a sub-prefix)."""
    return bool(key) and "/" not in key and not key.startswith(".")
