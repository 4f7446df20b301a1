"""Write a directory so readers see all of it or none of it: stage beside it, then rename."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a staging directory; on success it replaces FINAL in one rename, on error it is removed.

    The staging directory is a hidden sibling (same filesystem, so the rename is atomic) and
    is made world-readable: other roles (other uids) read what is published.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        staging.chmod(0o755)
        yield staging
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
