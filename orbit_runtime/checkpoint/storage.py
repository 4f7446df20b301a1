"""Object storage addressed by URI: `s3://bucket/prefix` or `file:///absolute/path`.

S3 goes through boto3, so any S3-compatible endpoint works (AWS, MinIO, Ceph). The endpoint,
region and credentials come from boto3's usual sources - environment variables such as
AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or AWS_SHARED_CREDENTIALS_FILE
pointing at a mounted Secret - never from the job config. Transient errors (connection
refused, timeouts, 5xx, throttling) are retried by botocore's standard retry mode with
exponential backoff; what still fails is raised as StorageError with credentials redacted.

Keys are relative to the URI's prefix and always use "/".
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from orbit_runtime.config.storage_uri import validate_storage_uri
from orbit_runtime.errors import OrbitError
from orbit_runtime.redaction import redact


class StorageError(RuntimeError):
    """Storage could not be reached or refused a request (after retries). Safe to log: redacted.
    TRANSIENT: the failure may pass by itself (a connection error, throttling, a 5xx), as opposed to a
    refusal that will not (AccessDenied, InvalidAccessKeyId, NoSuchBucket, no credentials)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


# S3 error codes that say "later", not "no" (throttling and the service's own failures)
TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                             "RequestTimeout", "RequestTimeoutException", "ServiceUnavailable", "InternalError"})  # fmt: skip


def transient_error(exc: Exception) -> bool:
    """Whether a boto3 exception may pass by itself: a connection or timeout error, throttling, a 5xx."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return exc.response.get("Error", {}).get("Code") in TRANSIENT_CODES or status >= 500 or status == 429
    return isinstance(exc, BotoConnectionError | HTTPClientError)


class ObjectNotFound(StorageError):
    """The key does not exist."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's prefix
    size: int
    etag: str | None = None  # S3's ETag (None for a file store): changes when the object is re-uploaded


class ObjectStore(Protocol):
    uri: str

    def put_file(self, key: str, path: Path) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def get_file(self, key: str, path: Path) -> None: ...
    def list(self, prefix: str = "") -> list[ObjectInfo]: ...
    def delete(self, keys: list[str]) -> None: ...


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def open_store(uri: str, *, retries: int = 4, connect_timeout_s: float = 5.0) -> ObjectStore:
    """The store for URI (no I/O yet). RETRIES: extra attempts per request on transient errors."""
    try:
        uri = validate_storage_uri(uri)
    except ValueError as exc:
        raise OrbitError(f"checkpoint URI {redact(uri)!r}: {exc}") from None
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return FileStore(Path(parsed.path))
    return S3Store(parsed.netloc, parsed.path.strip("/"), retries=retries, connect_timeout_s=connect_timeout_s)


class FileStore:
    """A directory as an object store; each file is written to a temp name, fsynced and renamed."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents and path != self.root.resolve():
            raise StorageError(f"{self.uri}: key {key!r} escapes the store")
        return path

    def _write(self, key: str, write) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.partial")
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise StorageError(f"{self.uri}: writing {key}: {exc}") from None

    def put_file(self, key: str, path: Path) -> None:
        def copy(f):
            with open(path, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)

        self._write(key, copy)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write(key, lambda f: f.write(data))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.uri}/{key}: not found") from None
        except OSError as exc:
            raise StorageError(f"{self.uri}: reading {key}: {exc}") from None

    def get_file(self, key: str, path: Path) -> None:
        try:
            shutil.copyfile(self._path(key), path)
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.uri}/{key}: not found") from None
        except OSError as exc:
            raise StorageError(f"{self.uri}: reading {key}: {exc}") from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        if not self.root.is_dir():
            return []
        out = []
        for path in sorted(self.root.rglob("*")):
            if path.is_file() and not path.name.endswith(".partial"):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    out.append(ObjectInfo(key, path.stat().st_size))
        return out

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            for parent in path.parents:  # drop directories the deletes left empty
                if parent == self.root or not parent.is_dir() or any(parent.iterdir()):
                    break
                parent.rmdir()


class S3Store:
    """An S3 bucket prefix through boto3 (uploads use s3transfer: multipart for large files)."""

    def __init__(self, bucket: str, prefix: str, *, retries: int, connect_timeout_s: float) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        config = Config(
            retries={"mode": "standard", "total_max_attempts": retries + 1},
            connect_timeout=connect_timeout_s,
            read_timeout=60,
        )
        self._s3 = boto3.session.Session().client("s3", config=config)

    @property
    def endpoint(self) -> str:
        """The endpoint URL boto3 resolved (AWS_ENDPOINT_URL, a config file, or the region's AWS endpoint)."""
        return str(self._s3.meta.endpoint_url)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, action: str, key: str, exc: Exception) -> StorageError:
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return ObjectNotFound(f"{self.uri}/{key}: not found")
        return StorageError(redact(f"{self.uri}: {action} {key or '(prefix)'} failed: {type(exc).__name__}: {exc}"),
                            transient=transient_error(exc))  # fmt: skip

    def put_file(self, key: str, path: Path) -> None:
        try:
            self._s3.upload_file(str(path), self.bucket, self._key(key))
        except Exception as exc:  # botocore/s3transfer raise many types; all mean "not stored"
            raise self._error("upload", key, exc) from None

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self._s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as exc:
            raise self._error("upload", key, exc) from None

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except Exception as exc:
            raise self._error("download", key, exc) from None

    def get_file(self, key: str, path: Path) -> None:
        try:
            self._s3.download_file(self.bucket, self._key(key), str(path))
        except Exception as exc:
            raise self._error("download", key, exc) from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = self._key("") if self.prefix else ""
        out = []
        try:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix):
                for item in page.get("Contents", []):
                    out.append(ObjectInfo(item["Key"][len(base) :], item["Size"], item.get("ETag") or None))
        except Exception as exc:
            raise self._error("list", prefix, exc) from None
        return out

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # the API's batch limit
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            try:
                response = self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            except Exception as exc:
                raise self._error("delete", batch[0]["Key"], exc) from None
            if response.get("Errors"):
                first = response["Errors"][0]
                raise StorageError(f"{self.uri}: delete {first.get('Key')} failed: {first.get('Code')} {first.get('Message')}")
