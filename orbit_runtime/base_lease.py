"""A cached base as the pod's roles hold it, and the atomic swap prepare-base replaces it with.

- Lease: every role holds a shared flock on the `model/` directory it mounted for as long as it runs
  (`hold_base_lease`; an inheritable descriptor, so vLLM keeps it across exec). The lock follows the
  inode through a rename, so cache-cleanup and prepare-base can tell a base (or a `.old-*`) that a
  running pod uses from one nobody uses (`unleased`: an exclusive non-blocking try).
- Identity: prepare-base writes the digest of the base it prepared into a file the pod's roles share
  (BASE_ID_FILE, an emptyDir). The roles mount `model/` by subPath, which the kubelet resolves again
  when a sidecar restarts in place: after another pod swapped in a rebuilt base, that sidecar would
  serve the new base while the learner trains on the old one. `enter_base` compares the mounted base's
  recorded digest (its manifest: no hashing) with that file and refuses to start on a mismatch.
- Swap: `exchange` swaps two directories in one step (renameat2 RENAME_EXCHANGE, Linux >= 3.15 and
  glibc >= 2.28), so `model/` never goes missing while a base is replaced; where the call is not
  available it is a rename aside then a rename into place (a moment without `model/`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
from pathlib import Path

from orbit_runtime.errors import OrbitError

BASE_ID_DIR = "/var/run/orbit-base"  # the pod's `base-id` emptyDir: written by prepare-base, read by the roles
BASE_ID_FILE = Path(BASE_ID_DIR) / "digest"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def hold_base_lease(model_dir: Path) -> int | None:
    """A shared flock on MODEL_DIR held for this process's life (the descriptor is inheritable, so a
    program it execs keeps it): cache-cleanup never removes a base a running role holds. None when it
    cannot be taken (no such directory, a filesystem without flock, cache-cleanup removing it now)."""
    try:
        fd = os.open(model_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.set_inheritable(fd, True)
    return fd


def try_flock(path: Path, flags: int) -> int | None:
    """A descriptor of PATH (opened with FLAGS) holding an exclusive flock, taken without waiting; None if
    someone else holds one."""
    fd = os.open(path, flags)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def unleased(path: Path) -> int | None:
    """A descriptor of the directory PATH holding an exclusive flock (so no role holds its lease, and none
    can take one until it is closed), or None if a role holds one."""
    return try_flock(path, os.O_RDONLY | os.O_DIRECTORY)


def recorded_digest(model_dir: Path) -> str | None:
    """The digest MODEL_DIR's manifest records (read, not verified: cheap), or None without a readable one."""
    from orbit_runtime.int4.base_digest import MANIFEST  # here: the operator imports this module's constants, never int4

    try:
        digest = json.loads((Path(model_dir) / MANIFEST).read_text()).get("digest")
    except (OSError, ValueError, AttributeError):
        return None
    return digest if isinstance(digest, str) else None


def write_base_id(path: Path, digest: str) -> None:
    """Record DIGEST (the base prepare-base just prepared) in PATH for the pod's roles (enter_base)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(digest + "\n")
    os.replace(tmp, path)


def check_base_identity(model_dir: Path, base_id: Path = BASE_ID_FILE) -> None:
    """OrbitError when the base mounted at MODEL_DIR is not the one this pod's prepare-base prepared (BASE_ID,
    when it exists: a pod without it, or `orbit train` outside a pod, is not checked)."""
    try:
        expected = Path(base_id).read_text().strip()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OrbitError(f"{base_id}: cannot read the digest prepare-base recorded ({exc.strerror or exc})") from None
    found = recorded_digest(model_dir)
    if found != expected:
        held = f"holds {found}" if found else "holds no base (evicted?)"
        raise OrbitError(f"the node's base changed under this pod: {model_dir} {held}, but this pod's prepare-base prepared "
                         f"{expected} (another pod rebuilt or evicted the base since); the pod fails and its replacement "
                         "prepares the base again")  # fmt: skip


def enter_base(model_dir: Path, base_id: Path | None = None) -> int | None:
    """What a role does first: take the lease on its base, then make sure it is this pod's base (check_base_identity).
    The lease descriptor (inheritable; None if it could not be taken)."""
    fd = hold_base_lease(Path(model_dir))
    check_base_identity(Path(model_dir), BASE_ID_FILE if base_id is None else base_id)
    return fd


def exchange(a: Path, b: Path) -> bool:
    """Swap the directories A and B atomically (renameat2 RENAME_EXCHANGE); False where the system does
    not offer it (an old kernel or libc, a filesystem without it), leaving both as they were."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))
