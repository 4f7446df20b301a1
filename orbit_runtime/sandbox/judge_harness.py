"""Inside the sandbox, trusted: run the tests against the program, which runs in another process.

Standard library only (the sandbox has no site-packages). The program (`judge_runner.py`) is
a child process: the tests' asserts run here, on plain values it answers (`ast.literal_eval`),
so a program cannot fake a pass by patching the tests, the asserts, the harness or the
comparison (an object whose `==` is always true never crosses). This process is made
non-dumpable first, so the child (same uid) can neither ptrace it nor open its descriptors.

A test is a statement with an `assert` that calls the program: a top-level one (MBPP style),
or one of the body of `check(candidate)` (HumanEval style, `candidate` being the entry point).
Other statements are setup; when one fails, the tests after it fail. Only the names the tests
need from the program are proxies into the child (`plan_tests`); builtins, the tests' own
names and the task stub's helpers are never the program's.

Reads {"tests", "entry_point", "wall_seconds", "output_bytes"} (JSON) on stdin; the program
never sees the tests. Writes JSON lines on stdout: {"total": m}, one {"test": i, "passed": bool} per test as it is
judged, then {"status": ...}.

With {"mode": "run"} instead (the `python` tool) there are no tests: the program runs once, and
the one line written is {"status": ..., "output": what it printed, "error": what it raised}.
"""

import ast
import builtins
import ctypes
import json
import os
import resource
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


class TestsInvalid(Exception):
    """The tests cannot be judged as given (a check() without an entry point, no test at all)."""


def _bound_names(tree: ast.AST) -> set[str]:
    """Names TREE assigns, defines or imports anywhere (its own helpers and variables)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
            bound.update(a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound


def stub_module(stub: str) -> ast.Module:
    """The task's stub as code (HumanEval's helpers, e.g. encode_cyclic: trusted, they run here); a
    stub that stops inside its last function (`def f():`, `return `) is closed with `pass`."""
    for text in (stub, stub + "\n    pass\n"):
        try:
            return ast.parse(text)
        except (SyntaxError, ValueError):
            continue
    return ast.Module(body=[], type_ignores=[])


def _stub_names(stub: str) -> set[str]:
    return _bound_names(stub_module(stub))


def plan_tests(tests: str, entry_point: str | None, stub: str = "") -> tuple[list[ast.stmt], list[bool], set[str]]:
    """(statements in order, which are tests, the program's names they call).

    The statements: check()'s body after the module's other statements when the tests define
    check(candidate) (then the entry point is required), else the module. The program's names:
    `candidate` (the entry point) and the names the tests use but neither define, nor import,
    nor take from the builtins or the stub; only these reach the program. A test is a statement
    with an assert that uses one of them (`assert True` tests nothing).
    """
    module = ast.parse(tests)
    check = next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is not None and not entry_point:
        raise TestsInvalid("the tests define check(candidate): name the entry point it is called with")
    statements = [n for n in module.body if n is not check] + (check.body if check is not None else [])
    bound = _bound_names(module) | set(dir(builtins)) | _stub_names(stub)
    used = {n.id for s in statements for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    program_names = (used - bound) | ({"candidate"} if check is not None else set())
    if entry_point and entry_point in used:
        program_names.add(entry_point)

    def is_test(statement: ast.stmt) -> bool:
        names = {n.id for n in ast.walk(statement) if isinstance(n, ast.Name)}
        return any(isinstance(n, ast.Assert) for n in ast.walk(statement)) and bool(names & program_names)

    flags = [is_test(s) for s in statements]
    if not any(flags):
        raise TestsInvalid("the tests have no assert that calls the program")
    return statements, flags, program_names


IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGXCPU)


def _default_signals() -> None:
    for number in IGNORED_SIGNALS:
        signal.signal(number, signal.SIG_DFL)


class Program:
    """The child process running the program, and the calls into it."""

    def __init__(self, deadline: float, output_limit: int) -> None:
        self.deadline = deadline
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-W", "ignore", os.path.join(JUDGE, "judge_runner.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/tmp", close_fds=True,
            preexec_fn=_default_signals,  # the harness ignores signals; the program must not (SIGXCPU: its CPU limit)
        )  # fmt: skip
        self.output_exceeded = False
        self.ended = False
        self._buffer = b""
        self.output: list[bytes] = []  # what it printed, up to the limit (run mode returns it)
        self.drain = threading.Thread(target=self._drain_output, args=(output_limit,), daemon=True)
        self.drain.start()

    def _drain_output(self, limit: int) -> None:
        """Keep what the program prints; past LIMIT bytes it is killed."""
        seen = 0
        while chunk := self.process.stderr.read1(65536):
            self.output.append(chunk[: max(0, limit - seen)])  # what fits: run mode returns it with the error
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
    for number in IGNORED_SIGNALS:
        signal.signal(number, signal.SIG_IGN)  # the program's signals (SIGKILL and SIGSTOP from inside: pid 1 ignores)
    # the tests come on stdin, never as a file: the program must not read them (it could answer
    # each assert's expected value without solving anything)
    meta = json.loads(sys.stdin.read())
    sys.stdin.close()
    # the program's processes, counted in the sandbox's own user namespace (the kernel counts a
    # uid per namespace; outside it the uid may run anything on the node)
    resource.setrlimit(resource.RLIMIT_NPROC, (meta["processes"], meta["processes"]))
    if meta.get("mode") == "run":
        run_once(meta)
        return
    try:
        statements, flags, program_names = plan_tests(meta["tests"], meta.get("entry_point"), meta.get("stub", ""))
    except (TestsInvalid, SyntaxError) as exc:
        emit(status="sandbox_error", detail=str(exc))
        return
    emit(total=sum(flags))
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

    namespace: dict = {"__name__": "tests"}
    try:  # the stub's helpers (trusted task data) run here; its unfinished entry point is replaced below
        exec(compile(stub_module(meta.get("stub", "")), "stub.py", "exec"), namespace)
    except Exception:  # noqa: BLE001 - a stub whose top level fails leaves its helpers undefined: their tests fail
        pass
    defined = {n for n in loaded.get("names", []) if isinstance(n, str)}
    for name in program_names:
        if name == "candidate":
            namespace[name] = proxy(meta["entry_point"])
        elif name in defined:  # a name the program lacks stays unbound: its test fails with NameError
            namespace[name] = proxy(name)
    index = 0
    broken = False
    memory = False
    for statement, test in zip(statements, flags, strict=True):
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


CLEAN_EXITS = ("None", "0", "")  # sys.exit(), sys.exit(0): the program ended as it meant to


def run_once(meta: dict) -> None:
    """Run mode: the program runs to its end (or its limits), then report its status and output."""
    deadline = time.monotonic() + meta["wall_seconds"]
    program = Program(deadline, meta["output_bytes"])
    try:
        loaded = program.receive()  # the runner answers once the program's top level has run
    except ProgramGone:
        loaded = None
    try:
        program.process.stdin.close()  # no calls: the runner ends
    except OSError:
        pass
    hung = False
    try:
        code = program.process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # its top level ended but the process did not (a thread, an atexit hook)
        code, hung = None, True
    error = None
    if loaded is None:  # no answer: its limits ended it, or it left without one (os._exit)
        status = program.status()
        if status == "crashed" and code == 0:
            status = "ok"
        elif status == "crashed":
            error = f"exit status {code}" if code is not None and code >= 0 else f"killed by signal {-(code or 0)}"
    elif loaded.get("loaded") or (loaded.get("error") == "SystemExit" and str(loaded.get("detail")) in CLEAN_EXITS):
        status = "timeout" if hung else "ok"
    else:  # it raised: its own error, reported as such
        status = {"SyntaxError": "syntax_error", "MemoryError": "memory"}.get(loaded.get("error"), "crashed")
        error = f"{loaded.get('error')}: {loaded.get('detail', '')}"
    program.process.kill()
    program.drain.join(timeout=max(0.1, deadline + 0.5 - time.monotonic()))
    if program.output_exceeded:
        status = "output_limit"
    emit(status=status, output=b"".join(program.output).decode(errors="replace"), error=error)


if __name__ == "__main__":
    main()
