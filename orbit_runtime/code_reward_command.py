"""`orbit code-reward PROGRAM.py --tests TESTS.py`: judge one program exactly as training does.

Exit 0 whenever the program was judged (a hostile program is a judged program, reward 0);
exit 2 with one line when it could not be (bwrap missing, a file unreadable, tests without
an assert).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer, fail: Callable[[Exception], None]) -> None:
    @app.command("code-reward")
    def code_reward(
        program: Annotated[Path, typer.Argument(help="The program (a completion, or the code in it).")],
        tests: Annotated[Path, typer.Option("--tests", help="MBPP-style top-level asserts, or check(candidate) with --entry-point.")],
        entry_point: Annotated[str | None, typer.Option(help="The function check(candidate) is called with (HumanEval).")] = None,
        stub: Annotated[Path | None, typer.Option(help="A stub the program continues (HumanEval's prompt).")] = None,
        extract: Annotated[str, typer.Option(help="fenced: the first fenced code block, else the whole text; text: the whole text.")] = "fenced",
        wall_seconds: Annotated[float, typer.Option(help="Wall-time limit.")] = 10.0,
        cpu_seconds: Annotated[int, typer.Option(help="CPU-time limit.")] = 5,
        memory_mb: Annotated[int, typer.Option(help="Address-space limit of each process.")] = 512,
        as_json: Annotated[bool, typer.Option("--json", help="Print the verdict as one JSON object.")] = False,
    ) -> None:
        """Judge PROGRAM against its tests in the sandbox training uses; print passed, total, reward, status."""
        from orbit_runtime.errors import OrbitError
        from orbit_runtime.rewards.code import CodeTask, count_tests, judge, program_for
        from orbit_runtime.sandbox.bwrap import SandboxLimits, check_sandbox_tools

        try:
            texts = {}
            for role, path in (("PROGRAM", program), ("--tests", tests), ("--stub", stub)):
                if path is not None:
                    try:
                        texts[role] = path.read_text()
                    except (OSError, UnicodeDecodeError) as exc:
                        raise OrbitError(f"{role} {path}: cannot read it ({exc})") from None
            count_tests(texts["--tests"], entry_point, texts.get("--stub", ""))
            check_sandbox_tools()
            task = CodeTask(texts["--tests"], entry_point, texts.get("--stub", ""))
            limits = SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_mb=memory_mb)
            verdict = judge(program_for(texts["PROGRAM"], task, extract), task, limits)
        except OrbitError as exc:
            fail(exc)
            return
        if verdict.status == "sandbox_error":
            fail(OrbitError(f"the sandbox could not judge the program: {verdict.detail}"))
        if as_json:
            typer.echo(json.dumps(verdict.as_json()))
        else:
            typer.echo(f"{verdict.passed}/{verdict.total} tests passed, reward {verdict.reward:.3f}, status {verdict.status}")
