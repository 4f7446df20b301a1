"""Inside the sandbox, trusted: run the tests against the program, which runs in another process.

Standard library only (the sandbox has no site-packages). The program (`judge_runner.py`) is
a child process: the tests' asserts run here, on plain values it answers (`ast.literal_eval`),
so a program cannot fake a pass by patching the tests, the asserts, the harness or the
comparison (an object whose `==` is always true never crosses). This process is made
non-dumpable first, so the child (same uid) can neither ptrace it nor open its descriptors.

A test is a statement that contains an `assert`: a top-level one (MBPP style), or one of the
body of `check(candidate)` (HumanEval style, `candidate` being the entry point). Other
statements are setup; when one fails, the tests after it fail. Every program function the
tests name is a proxy that calls into the child.

Reads {"tests", "entry_point", "wall_seconds", "output_bytes"} (JSON) on stdin; the program
never sees the tests. Writes JSON lines on stdout: {"total": m}, one {"test": i, "passed": bool} per test as it is
judged, then {"status": ...}.
"""

import ast
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

JUDGE = "/judge"
PR_SET_DUMPABLE = 4


class ProgramGone(Exception):
    """The program's process ended (or broke the protocol): no more calls can be answered."""


class ProgramRaised(Exception):
    """A call into the program raised ERROR (its type name): the test fails."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def test_statements(tests: str, entry_point: str | None) -> tuple[list[ast.stmt], str]:
    """(statements in order, where they run): check's body if the tests define check(), else the module."""
    module = ast.parse(tests)
    check = next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is not None and entry_point:
        setup = [n for n in module.body if n is not check]
        return setup + check.body, "check"
    return module.body, "module"


def is_test(statement: ast.stmt) -> bool:
    return any(isinstance(node, ast.Assert) for node in ast.walk(statement))


class Program:
    """The child process running the program, and the calls into it."""

    def __init__(self, deadline: float, output_limit: int) -> None:
        self.deadline = deadline
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.join(JUDGE, "judge_runner.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/tmp", close_fds=True,
        )  # fmt: skip
        self.output_exceeded = False
        self.ended = False
        self._buffer = b""
        threading.Thread(target=self._drain_output, args=(output_limit,), daemon=True).start()

    def _drain_output(self, limit: int) -> None:
        """Count what the program prints; past LIMIT bytes it is killed."""
        seen = 0
        while chunk := self.process.stderr.read1(65536):
            seen += len(chunk)
            if seen > limit:
                self.output_exceeded = True
                self.process.kill()
                return

    def receive(self) -> dict:
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise ProgramGone("no answer before the deadline")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self.ended = True
                raise ProgramGone("the program's process ended")
            self._buffer += chunk
            if len(self._buffer) > 4 << 20:
                raise ProgramGone("an answer too large")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            raise ProgramGone("a malformed answer") from None
        if not isinstance(message, dict):
            raise ProgramGone("a malformed answer")
        return message

    def call(self, name: str, args: tuple):
        try:
            self.process.stdin.write((json.dumps({"call": name, "args": repr(args)}) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise ProgramGone("the program's process ended") from None
        reply = self.receive()
        if not reply.get("ok"):
            raise ProgramRaised(str(reply.get("error")))
        return ast.literal_eval(reply["value"])  # plain data only: no object of the program's reaches a test

    def status(self) -> str:
        """What ended the program: why its answers stopped, or ok."""
        if self.output_exceeded:
            return "output_limit"
        late = time.monotonic() >= self.deadline
        code = self.process.poll()
        if code is None and self.ended:  # its pipe closed before it was reaped: let its exit status arrive
            try:
                code = self.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        if code is None:  # still serving calls
            return "timeout" if late else "ok"
        if code == -signal.SIGXCPU or (code == -signal.SIGKILL and late):
            return "timeout"
        if code == -signal.SIGXFSZ:
            return "output_limit"
        return "crashed"  # it ended while it should have been answering (an exit, a signal, os._exit(0) too)


def main() -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        emit(status="sandbox_error", detail="prctl(PR_SET_DUMPABLE) failed")
        return
    # the tests come on stdin, never as a file: the program must not read them (it could answer
    # each assert's expected value without solving anything)
    meta = json.loads(sys.stdin.read())
    sys.stdin.close()
    statements, _ = test_statements(meta["tests"], meta.get("entry_point"))
    tests = [s for s in statements if is_test(s)]
    emit(total=len(tests))
    program = Program(time.monotonic() + meta["wall_seconds"], meta["output_bytes"])
    try:
        loaded = program.receive()
    except ProgramGone:
        emit(status=program.status() if program.status() != "ok" else "crashed")
        return
    if not loaded.get("loaded"):
        error = loaded.get("error")
        emit(status={"SyntaxError": "syntax_error", "MemoryError": "memory"}.get(error, "crashed"), detail=error)
        return

    def proxy(name: str):
        return lambda *args: program.call(name, args)

    namespace = {"__name__": "tests"}
    names = [n for n in loaded.get("names", []) if isinstance(n, str)]
    namespace.update({name: proxy(name) for name in names})
    if meta.get("entry_point"):
        namespace["candidate"] = proxy(meta["entry_point"])
    index = 0
    broken = False
    memory = False
    for statement in statements:
        test = is_test(statement)
        passed = False
        if not broken:
            try:
                exec(compile(ast.Module(body=[statement], type_ignores=[]), "tests.py", "exec"), namespace)
                passed = True
            except ProgramGone:
                broken = True
            except Exception as exc:  # noqa: BLE001 - a failed assert, or the program raised
                memory = memory or isinstance(exc, MemoryError) or getattr(exc, "error", None) == "MemoryError"
                if not test:
                    broken = True  # the tests' setup failed: what follows cannot run
        if test:
            emit(test=index, passed=passed)
            index += 1
    status = program.status()
    if status == "ok" and memory:
        status = "memory"
    program.process.kill()
    emit(status=status)


if __name__ == "__main__":
    main()
