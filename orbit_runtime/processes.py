"""Child server processes (vLLM rollout, reference) that never outlive the learner.

Each server runs in its own process group, so stopping it stops its workers too, and asks
the kernel to SIGTERM it if the learner dies (PR_SET_PDEATHSIG), so even a `kill -9` of the
learner leaves no orphan holding memory and ports. Output goes to a log file whose tail is
quoted in every error.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from orbit_runtime.redaction import environment_without_secrets

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on HOST."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: stop() still cleans up on a normal exit


class ManagedServer:
    """An HTTP server child process with a health endpoint. Context manager or start()/stop()."""

    name = "server"

    def __init__(self, command: list[str], *, port: int, host: str, env: dict[str, str], log_path: Path,
                 health_path: str = "/health") -> None:  # fmt: skip
        self.command = command
        self.port = port
        self.host = host
        self.env = environment_without_secrets(env)  # roles other than the learner never touch storage
        self.log_path = Path(log_path)
        self.health_path = health_path
        self._process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, timeout_s: float = 300.0) -> ManagedServer:
        """Start the process and wait until its health endpoint answers 200."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # own process group: stop() kills workers too
                preexec_fn=_die_with_parent,
            )
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                raise RuntimeError(f"{self.name} exited with code {code} while starting; log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}{self.health_path}", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f}s; log {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def alive_after(self, grace_s: float) -> bool:
        """Whether the process is still running after up to GRACE_S seconds: a request can
        fail a moment before the kernel reports its server dead."""
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.alive()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after GRACE_S."""
        if self._process is None:
            return
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGTERM)
                self._process.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:  # workers may outlive the parent; the group id is the parent's pid
            os.killpg(self._process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._process.wait()
        self._process = None

    def __enter__(self):
        return self.start() if self._process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
