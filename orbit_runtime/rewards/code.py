"""Code-execution reward: a program's pass rate against its tests, judged in the sandbox.

    rewards:
      - function: code_tests                # answers: each task's tests (see `CodeTask`)
        kwargs: {extract: fenced, concurrency: 4, wall_seconds: 10}

`code_tests(completions, answers=...)` takes the program out of each completion (`extract`:
`fenced`, the first fenced code block, else the whole text; `text`, the whole text), puts the
task's stub in front of it when the program does not define the entry point itself (HumanEval
completions continue the stub), and judges up to `concurrency` programs at once, each in a
sandbox of its own (`orbit_runtime/sandbox/bwrap.py`). A program that cannot pass (a syntax
error, a timeout, a hostile one) scores what it passed before it stopped: 0 for a hostile one.
A sandbox that cannot start raises (the scorer counts the sample as a failed reward), so a
broken sandbox is never mistaken for a wrong program.
"""

from __future__ import annotations

import ast
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from orbit_runtime.data.code_tasks import CodeTask
from orbit_runtime.errors import OrbitError
from orbit_runtime.observability.sandbox_metrics import observe_code_verdict
from orbit_runtime.sandbox.bwrap import SandboxLimits, SandboxUnavailable, Verdict, judge_program
from orbit_runtime.sandbox.judge_harness import TestsInvalid, plan_tests

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
EXTRACTIONS = ("fenced", "text")


def extract_program(completion: str, extract: str = "fenced") -> str:
    """The program in a completion: the first fenced code block, else the whole text (`fenced`); or the whole text."""
    if extract not in EXTRACTIONS:
        raise OrbitError(f"code_tests extract {extract!r}: expected one of {', '.join(EXTRACTIONS)}")
    if extract == "fenced" and (match := _FENCE.search(completion)):
        return match.group(1)
    return completion


def defines(program: str, name: str) -> bool:
    """Whether PROGRAM defines NAME at top level (False when it does not parse)."""
    try:
        module = ast.parse(program)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == name for n in module.body)


def program_for(completion: str, task: CodeTask, extract: str = "fenced") -> str:
    """What runs: the extracted program, after the task's stub unless it defines the entry point itself."""
    program = extract_program(completion, extract)
    if task.stub and not (task.entry_point and defines(program, task.entry_point)):
        return task.stub + program
    return program


def count_tests(tests: str, entry_point: str | None = None, stub: str = "") -> int:
    """Tests the harness will count (the same `plan_tests`); raises OrbitError when the tests cannot be judged."""
    try:
        return sum(plan_tests(tests, entry_point, stub)[1])
    except SyntaxError as exc:
        raise OrbitError(f"tests do not parse: {exc}") from None
    except TestsInvalid as exc:
        raise OrbitError(str(exc)) from None


def judge(program: str, task: CodeTask, limits: SandboxLimits | None = None) -> Verdict:
    """One program, judged as training judges it, and counted in the metrics."""
    verdict = judge_program(program, task.tests, task.entry_point, limits or SandboxLimits(), task.stub)
    observe_code_verdict(verdict.status, verdict.seconds)
    return verdict


def code_tests(
    completions: list[str],
    *,
    answers: list[str | None],
    extract: str = "fenced",
    concurrency: int = 4,
    cpu_seconds: int = 5,
    wall_seconds: float = 10.0,
    memory_mb: int = 512,
    **_: Any,
) -> list[float]:
    """The pass rate of each completion's program against its task's tests (see the module docstring)."""
    if concurrency < 1:
        raise OrbitError(f"code_tests concurrency {concurrency}: must be at least 1")
    limits = SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_mb=memory_mb)
    tasks = [CodeTask.from_answer(a) for a in answers]
    programs = [program_for(c, t, extract) for c, t in zip(completions, tasks, strict=True)]
    with ThreadPoolExecutor(max_workers=min(concurrency, len(programs)) or 1, thread_name_prefix="orbit-judge") as pool:
        verdicts = list(pool.map(lambda pair: judge(*pair, limits), zip(programs, tasks, strict=True)))
    broken = [v for v in verdicts if v.status == "sandbox_error"]
    if broken:
        raise SandboxUnavailable(f"code_tests: the sandbox failed for {len(broken)} of {len(verdicts)} programs: {broken[0].detail}")
    return [v.reward for v in verdicts]
