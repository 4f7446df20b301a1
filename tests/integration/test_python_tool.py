"""The built-in `python` tool runs the model's program in the real code sandbox (bwrap) and answers
with what it printed; failures, hostile programs and limits answer with an error, never crash the run."""

from __future__ import annotations

import socket

from orbit_runtime.data.datasets import Example
from orbit_runtime.environments.python_tool import python
from orbit_runtime.environments.tool_calls import format_tool_call
from orbit_runtime.environments.tools import ToolEnvironment, load_tool
from orbit_runtime.sandbox.bwrap import SandboxLimits, run_program


def test_a_tool_call_runs_the_program_in_the_sandbox_and_its_output_is_the_tool_message():
    env = ToolEnvironment([load_tool("python")], timeout_s=10.0)
    state = env.reset(Example("What is 2**100 % 97?", "16"))
    assert env.tools(state.example)[0]["function"]["name"] == "python"
    call = format_tool_call("python", {"code": "import math\nprint(pow(2, 100, 97))\nprint(math.factorial(5))"})
    reply = env.step(state, {"role": "assistant", "content": call})
    assert reply.messages == [{"role": "tool", "name": "python", "content": "16\n120\n"}] and not reply.done


def test_failures_answer_with_what_went_wrong():
    assert python("x = 1") == "(the program printed nothing)"
    try:
        python("print('before')\n1 / 0")
    except ValueError as error:
        assert "it raised: ZeroDivisionError: division by zero" in str(error) and "before" in str(error)
    else:
        raise AssertionError("a raising program answered as if it had succeeded")
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=3, output_bytes=1024)
    assert run_program("while True: pass", limits).status == "timeout"  # its CPU limit
    assert run_program("import time\nprint('a', flush=True)\ntime.sleep(100)", limits).status == "timeout"  # wall time
    hung = run_program("import threading, time\nthreading.Thread(target=time.sleep, args=(100,)).start()", limits)
    assert hung.status == "timeout"  # the top level ended, the process did not
    too_much = run_program("print('x' * 5000)", limits)
    assert too_much.status == "output_limit" and too_much.output == "x" * 1024  # what fits is kept
    assert run_program("def f(:\n", limits).status == "syntax_error"
    assert run_program("[0] * 10**10", limits).status == "memory"
    for clean in ("import sys\nprint(1)\nsys.exit()", "import sys\nprint(1)\nsys.exit(0)", "import os\nprint(1, flush=True)\nos._exit(0)"):
        run = run_program(clean, limits)
        assert (run.status, run.output) == ("ok", "1\n"), (clean, run)
    exited = run_program("import os\nos._exit(3)", limits)
    assert (exited.status, exited.error) == ("crashed", "exit status 3")


def test_the_program_sees_nothing_of_the_host(tmp_path):
    """The run's files and a listener on the host's loopback: the python tool runs in the code_tests
    sandbox, so tests/integration/test_code_sandbox.py's hostile programs apply to it as well."""
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    program = (f"import os, socket\nprint(os.path.exists({str(secret)!r}), os.path.exists({str(tmp_path)!r}))\n"
               f"s = socket.socket()\ntry:\n    s.connect(('127.0.0.1', {port}))\n    print('reached the host')\n"
               "except OSError:\n    print('no host loopback')\n")  # fmt: skip
    with listener:
        run = run_program(program)
    assert run.status == "ok", run
    assert run.output.splitlines() == ["False False", "no host loopback"]
    assert secret.read_text() == "s3cr3t"


def test_a_job_naming_python_without_bwrap_fails_at_its_start_naming_the_tool(monkeypatch):
    import pytest

    from orbit_runtime.errors import OrbitError

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(OrbitError, match="environment.tools: python: bwrap not found"):
        load_tool("python")
