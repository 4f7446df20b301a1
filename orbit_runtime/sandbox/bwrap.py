"""Judge one program in a bubblewrap sandbox (or run it once: the `python` tool), with limits, leaving nothing behind.

The sandbox (`bwrap_argv`, pure) has every namespace unshared (no network: only its own
loopback; its own pid namespace, so it cannot see or signal the learner), a read-only /usr,
no /proc, and nothing else of the host: not the run's files, its credentials or its environment
(`--clearenv`). Its one writable place is a private, size-capped /tmp. Limits come from
`prlimit` (CPU seconds, address space, file size), from the harness inside (processes: the
kernel counts them per user namespace, so the sandbox's own count starts at its harness) and
from here (wall time, output). When the run runs as root, the sandbox runs as an unprivileged
uid so the process limit binds (the kernel does not apply RLIMIT_NPROC to root). When it
returns, the sandbox's whole process tree is gone: the harness is its pid namespace's pid 1,
and when that dies the kernel kills the rest.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from orbit_runtime.errors import OrbitError

HERE = Path(__file__).resolve().parent
JUDGE_FILES = ("judge_harness.py", "judge_runner.py")
STATUSES = ("ok", "timeout", "memory", "output_limit", "crashed", "syntax_error", "sandbox_error")
NOBODY = 65534


class SandboxUnavailable(OrbitError):
    """bwrap (or prlimit, or a Python for the sandbox) is missing or cannot make a sandbox here."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one judged program may use."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 512  # address space of each process in the sandbox
    processes: int = 32  # processes and threads in the sandbox (its harness's included)
    file_size_mb: int = 8  # the largest file it may write
    tmp_mb: int = 32  # its whole /tmp
    output_bytes: int = 64 * 1024  # what the program may print


@dataclass(frozen=True)
class Verdict:
    passed: int
    total: int
    status: str  # one of STATUSES
    seconds: float
    detail: str = ""

    @property
    def reward(self) -> float:
        """The pass rate: tests that passed before the program stopped count, the rest do not."""
        return self.passed / self.total if self.total else 0.0

    def as_json(self) -> dict:
        return {"passed": self.passed, "total": self.total, "reward": self.reward, "status": self.status}


def sandbox_python() -> tuple[str, str | None]:
    """(interpreter, prefix to bind read-only or None): the system's python3 under /usr, else this one's own."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate, None
    prefix = os.path.realpath(sys.base_prefix)
    return os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}"), prefix


@functools.cache
def bwrap_version() -> tuple[int, ...]:
    """bwrap's version, e.g. (0, 8, 0); (0,) when it does not say."""
    try:
        out = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return (0,)


def bwrap_argv(judge_dir: Path, limits: SandboxLimits, python: str, python_prefix: str | None, info_fd: int | None = None,
               sized_tmpfs: bool = True) -> list[str]:  # fmt: skip
    """The command that runs the judge harness in the sandbox (pure). INFO_FD: where bwrap writes
    the harness's pid (so a hung sandbox is killed from its pid 1 down, leaving no orphan).
    SIZED_TMPFS: bwrap takes --size (0.8 and later); without it the sandbox gets no writable
    directory at all (an uncapped tmpfs is memory no limit counts)."""
    argv = [
        # SIGXCPU at the soft CPU limit (the judge reports a timeout), SIGKILL a second later
        # (the process limit is set inside, by the harness: see judge_harness.py)
        "prlimit", f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}", f"--as={limits.memory_mb << 20}",
        f"--fsize={limits.file_size_mb << 20}", "--core=0", "--",
        "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL",
        *(["--info-fd", str(info_fd)] if info_fd is not None else []),
        "--ro-bind", "/usr", "/usr",
    ]  # fmt: skip
    for link in ("bin", "lib", "lib64", "sbin"):
        target = Path("/") / link
        if target.is_symlink():
            argv += ["--symlink", os.readlink(target), f"/{link}"]
        elif target.is_dir():
            argv += ["--ro-bind", str(target), f"/{link}"]
    if python_prefix:
        argv += ["--ro-bind", python_prefix, python_prefix]
    argv += [
        # no /proc: a container masks parts of its own, so mounting one needs privileges. /dev read-only and
        # every tmpfs size-capped: tmpfs pages are memory no address-space limit counts
        "--dev", "/dev",
        *(["--size", str(1 << 20), "--tmpfs", "/dev/shm"] if sized_tmpfs else []), "--remount-ro", "/dev",
        *(["--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"] if sized_tmpfs else ["--dir", "/tmp"]),
        "--ro-bind", str(judge_dir), "/judge",
        "--remount-ro", "/",  # bwrap's own root is a tmpfs too: read-only, like all but the capped ones
        "--chdir", "/tmp",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        python, "-I", "-S", "-W", "ignore", "/judge/judge_harness.py",
    ]  # fmt: skip
    return argv


def check_sandbox_tools() -> None:
    """Raise SandboxUnavailable naming what is missing."""
    for tool in ("bwrap", "prlimit"):
        if shutil.which(tool) is None:
            raise SandboxUnavailable(f"{tool} not found on PATH: the code sandbox needs bubblewrap and util-linux's prlimit")


def _read_capped(stream, limit: int, out: list[bytes]) -> None:
    """Keep LIMIT bytes of STREAM and drain the rest (a full pipe would stall the sandbox)."""
    size = 0
    while chunk := stream.read1(65536):
        if size < limit:
            out.append(chunk[: limit - size])
        size += len(chunk)


def judge_program(program: str, tests: str, entry_point: str | None, limits: SandboxLimits | None = None, stub: str = "") -> Verdict:
    """Run PROGRAM against TESTS in a fresh sandbox and say how it did (STUB: the task's, whose helpers the tests may call)."""
    limits = limits or SandboxLimits()
    # the tests go to the harness on its stdin: a file in the sandbox would let the program read the answers
    meta = {"tests": tests, "entry_point": entry_point, "stub": stub, "wall_seconds": limits.wall_seconds,
            "output_bytes": limits.output_bytes, "processes": limits.processes}  # fmt: skip
    started = time.monotonic()
    ran = _run_harness(program, meta, limits)
    if isinstance(ran, str):
        return Verdict(0, 0, "sandbox_error", time.monotonic() - started, ran)
    return _verdict(*ran, time.monotonic() - started)


@dataclass(frozen=True)
class ProgramRun:
    """How one program run in the sandbox ended (`run_program`): its status, what it printed, what it raised."""

    status: str  # one of STATUSES
    output: str
    error: str | None
    seconds: float


def run_program(program: str, limits: SandboxLimits | None = None) -> ProgramRun:
    """Run PROGRAM once in a fresh sandbox (the `python` tool): the same sandbox and limits as judging, no tests."""
    limits = limits or SandboxLimits()
    meta = {"mode": "run", "wall_seconds": limits.wall_seconds, "output_bytes": limits.output_bytes, "processes": limits.processes}
    started = time.monotonic()
    ran = _run_harness(program, meta, limits)
    if isinstance(ran, str):
        return ProgramRun("sandbox_error", "", ran, time.monotonic() - started)
    events, errors, timed_out, returncode = ran
    for line in reversed(events.splitlines()):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("status") in STATUSES:
            error = event.get("error") or event.get("detail")  # detail: why the harness could not run it
            return ProgramRun(event["status"], str(event.get("output", "")), error, time.monotonic() - started)
    status = "timeout" if timed_out else "sandbox_error"
    return ProgramRun(status, "", errors.strip()[-500:] or f"exit {returncode}", time.monotonic() - started)


def _run_harness(program: str, meta: dict, limits: SandboxLimits) -> tuple[str, str, bool, int] | str:
    """Run the harness on PROGRAM with META (on its stdin) in a fresh sandbox: (its stdout, bwrap's stderr,
    timed out, exit status), or why the sandbox could not start."""
    check_sandbox_tools()
    python, prefix = sandbox_python()
    with tempfile.TemporaryDirectory(prefix="orbit-judge-") as tmp:
        judge_dir = Path(tmp)
        for name in JUDGE_FILES:
            shutil.copyfile(HERE / name, judge_dir / name)
        (judge_dir / "program.py").write_text(program)
        judge_dir.chmod(0o755)  # readable by the sandbox's uid, writable by nobody in it (a read-only bind anyway)
        info_read, info_write = os.pipe()
        argv = bwrap_argv(judge_dir, limits, python, prefix, info_write, sized_tmpfs=bwrap_version() >= (0, 8))
        user = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
        try:
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, close_fds=True,
                                       pass_fds=(info_write,), **user)  # fmt: skip
        except OSError as exc:
            os.close(info_read)
            return f"cannot start the sandbox: {exc}"
        finally:
            os.close(info_write)
        events: list[bytes] = []
        errors: list[bytes] = []
        info: list[bytes] = []
        readers = [threading.Thread(target=_read_capped, args=(process.stdout, 1 << 20, events), daemon=True),
                   threading.Thread(target=_read_capped, args=(process.stderr, 1 << 16, errors), daemon=True),
                   threading.Thread(target=_read_capped, args=(os.fdopen(info_read, "rb"), 4096, info), daemon=True)]  # fmt: skip
        for reader in readers:
            reader.start()
        try:
            process.stdin.write(json.dumps(meta).encode())
            process.stdin.close()
        except OSError:  # bwrap died before the harness read it: its stderr says why
            pass
        timed_out = False
        try:
            process.wait(timeout=limits.wall_seconds + 2.0)  # the harness stops itself at wall_seconds
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_harness(b"".join(info))  # the namespace's pid 1: the kernel kills the rest, bwrap reaps it and exits
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        process.kill()  # (a no-op when bwrap has exited) its death takes its pid namespace along
        process.wait()
        for reader in readers:
            reader.join(timeout=5)
    return b"".join(events).decode(errors="replace"), b"".join(errors).decode(errors="replace"), timed_out, process.returncode


def _kill_harness(info: bytes) -> None:
    """SIGKILL the sandbox's pid 1, named by bwrap's --info-fd JSON ({"child-pid": N})."""
    try:
        os.kill(int(json.loads(info.decode().split("\n")[0])["child-pid"]), signal.SIGKILL)
    except (ValueError, KeyError, TypeError, IndexError, ProcessLookupError, PermissionError):
        pass


def _verdict(events: str, errors: str, timed_out: bool, returncode: int, seconds: float) -> Verdict:
    """The harness's JSON lines (and bwrap's stderr) -> a Verdict."""
    total, passed, status = 0, 0, None
    for line in events.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if "total" in event:
            total = int(event["total"])
        elif "test" in event:
            passed += bool(event.get("passed"))
        elif "status" in event:
            status = event["status"] if event["status"] in STATUSES else "sandbox_error"
    if status is None:
        if timed_out:
            status = "timeout"
        elif not events:  # bwrap or the harness never started
            return Verdict(0, 0, "sandbox_error", seconds, errors.strip()[-500:] or f"exit {returncode}")
        else:
            status = "crashed"
    return Verdict(min(passed, total), total, status, seconds)
