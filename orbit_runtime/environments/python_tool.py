"""The built-in `python` tool: the model's program runs once in the code sandbox (bwrap), and
what it printed is the tool's answer.

The sandbox is the one `code_tests` judges in (orbit_runtime/sandbox/bwrap.py): no network, no
host files but a read-only /usr, no environment, a private size-capped /tmp, and limits on CPU,
wall time, memory, processes and output. A program that fails answers with its error, so the
model can learn from it.
"""

from __future__ import annotations

from orbit_runtime.sandbox.bwrap import SandboxLimits, run_program

LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=8.0, output_bytes=8 * 1024)  # inside environment.tool_timeout_s's 10 s


def python(code: str) -> str:
    """Run a Python program (standard library only, no network, no files) and return what it prints.

    Args:
        code: a complete Python program; print() what you want to see
    """
    run = run_program(code, LIMITS)
    if run.status == "ok":
        return run.output or "(the program printed nothing)"
    why = {"timeout": "it ran out of time", "memory": "it ran out of memory", "output_limit": "it printed too much",
           "syntax_error": "a syntax error", "crashed": "it raised", "sandbox_error": "the sandbox failed"}[run.status]  # fmt: skip
    printed = f"\nit printed:\n{run.output}" if run.output else ""
    raise ValueError((f"{why}: {run.error}" if run.error else why) + printed) from None
