"""What a test-node container is made of (see tests/e2e/node.py): Kubernetes' `$(VAR)` expansion,
the container's process and reported state, and the pieces of its bwrap sandbox (the host's
tree rebuilt read-only around the pod's mount points, the pod user's identity files)."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import subprocess
import time
from pathlib import Path

BWRAP = "bwrap"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined variable is substituted, `$$` is `$`, anything else stays."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class PodError(Exception):
    """The pod cannot run on this node (a missing ConfigMap, an unsupported volume)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Container:
    """One container of a running pod: its spec, process and reported state."""

    def __init__(self, spec: dict, kind: str) -> None:
        self.spec, self.kind = spec, kind  # kind: init | sidecar | main
        self.name: str = spec["name"]
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.state: dict = {"waiting": {"reason": "PodInitializing"}}
        self.last_state: dict = {}
        self.started = self.ready = False
        self.next_start = 0.0  # when a container waiting in back-off starts again (monotonic)
        self.startup_deadline = float("inf")
        self.log_offset = 0  # where this start's output begins in the container's log file

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def main_pid(self, wait_s: float = 2.0) -> int | None:
        """The host PID of the container's command (bwrap's child, PID 1 in the sandbox); waits up to
        WAIT_S for bwrap to start it. None when the container is not running."""
        deadline = time.monotonic() + wait_s
        while self.running:
            with contextlib.suppress(OSError, ValueError):
                children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
                if children:
                    return int(children[0])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        return None

    def status(self) -> dict:
        doc = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "", "ready": self.ready,
               "started": self.started, "restartCount": self.restarts, "state": self.state}  # fmt: skip
        if self.last_state:
            doc["lastState"] = self.last_state
        return doc


def mirror_host_root(directory: str, mount_points: set[str]) -> list[str]:
    """bwrap arguments that rebuild the host's tree read-only on the sandbox's tmpfs root, leaving
    every mount point to its mount: a directory on the way to one is recreated and its other
    entries bound one by one, so no mount point is ever created on the host."""
    args: list[str] = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if path in ("/proc", "/dev") or path in mount_points:
            continue
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path) and any(m.startswith(path + "/") for m in mount_points):
            args += ["--dir", path, *mirror_host_root(path, mount_points)]
        else:
            args += ["--ro-bind", path, path]
    return args


def identity_files(directory: Path, uid: int, gid: int) -> list[tuple[str, str, bool]]:
    """Read-only binds of /etc/passwd and /etc/group naming UID, as a runtime image names its user
    (none when this host knows the UID already); the files are written under DIRECTORY."""
    try:
        pwd.getpwuid(uid)
        return []
    except KeyError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "passwd").write_text(Path("/etc/passwd").read_text() + f"orbit:x:{uid}:{gid}::/tmp:/usr/sbin/nologin\n")
    (directory / "group").write_text(Path("/etc/group").read_text() + f"orbit:x:{gid}:\n")
    return [(str(directory / "passwd"), "/etc/passwd", True), (str(directory / "group"), "/etc/group", True)]
