"""The form of a checkpoint storage URI (no I/O): checked when a job spec is read and again
when a store is opened. Lives in config so reading a spec never imports storage clients."""

from __future__ import annotations

from urllib.parse import urlparse


def validate_storage_uri(uri: str) -> str:
    """Check URI's form; raises ValueError naming the problem, never echoing credentials."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("s3", "file"):
        raise ValueError(
            f"unsupported scheme {parsed.scheme + '://' if parsed.scheme else '(none)'}; use s3://bucket/prefix or file:///path"
        )
    if "@" in parsed.netloc:
        raise ValueError("credentials must not be part of the URI; set them in the environment or a mounted Secret")
    if parsed.scheme == "s3" and not parsed.netloc:
        raise ValueError("s3 URI needs a bucket: s3://bucket/prefix")
    if parsed.scheme == "file" and (parsed.netloc or not parsed.path.startswith("/")):
        raise ValueError("file URI needs an absolute path: file:///absolute/path")
    return uri.rstrip("/")
