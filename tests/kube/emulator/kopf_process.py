"""A real kopf operator process against the emulator."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from .resources import REPO_ROOT
from .server import KubeEmulator

# --- a real kopf operator process -------------------------------------------------------------------------------


@contextlib.contextmanager
def kopf_operator(
    kube: KubeEmulator,
    *targets: str,
    log_path: str | os.PathLike[str],
    args: tuple[str, ...] = ("--standalone", "--all-namespaces"),
    env: Mapping[str, str] | None = None,
    stop_timeout: float = 10.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python -m kopf run <args> <targets>`` against the emulator for the ``with`` block.

    ``targets``: script paths and/or ``-m module`` pairs. Output (stdout+stderr) goes to ``log_path``; it is
    appended to the AssertionError if the process died early. Stopped with SIGINT (kopf's graceful exit),
    then killed after ``stop_timeout`` seconds.
    """
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", *args, *targets],
            env={**kube.env(), "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc
        except BaseException as e:
            if proc.poll() is not None and isinstance(e, AssertionError):
                raise AssertionError(f"{e}\nkopf exited with {proc.returncode}:\n{log_path.read_text()[-5000:]}") from e
            raise
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
