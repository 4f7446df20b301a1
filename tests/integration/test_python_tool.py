"""The built-in `python` tool runs the model's program in the real code sandbox (bwrap) and answers
with what it printed; failures, hostile programs and limits answer with an error, never crash the run."""

from __future__ import annotations

import os

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
    assert run_program("while True: pass", limits).status == "timeout"
    assert run_program("print('x' * 5000)", limits).status == "output_limit"
    assert run_program("def f(:\n", limits).status == "syntax_error"


def test_the_program_sees_nothing_of_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-s3cr3t")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    program = (f"import os, socket\nprint(sorted(os.environ))\nprint(os.path.exists({str(secret)!r}))\n"
               "s = socket.socket()\ntry:\n    s.connect(('1.1.1.1', 80))\n    print('network')\nexcept OSError:\n"
               "    print('no network')\n")  # fmt: skip
    run = run_program(program)
    assert run.status == "ok", run
    assert "aws-s3cr3t" not in run.output and "AWS_SECRET_ACCESS_KEY" not in run.output
    assert run.output.splitlines()[1:] == ["False", "no network"]
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "aws-s3cr3t"


def test_a_job_naming_python_without_bwrap_fails_at_its_start_naming_the_tool(monkeypatch):
    import pytest

    from orbit_runtime.errors import OrbitError

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(OrbitError, match="environment.tools: python: bwrap not found"):
        load_tool("python")
