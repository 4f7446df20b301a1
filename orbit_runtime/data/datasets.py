"""Examples (prompt text + reference answer) for training and held-out validation."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orbit_runtime.config.code_data import HumanEvalData, SyntheticCodeData
from orbit_runtime.config.environment import BfclData, EnvironmentData
from orbit_runtime.config.prompt_data import FileData, SyntheticArithmeticData
from orbit_runtime.data.code_tasks import humaneval_splits, synthetic_code_splits
from orbit_runtime.errors import OrbitError


@dataclass(frozen=True)
class Example:
    prompt: str  # the user's text, before any chat template
    answer: str | None
    source: Any = field(default=None, compare=False)  # an environment's own record of it (a verifiers task's index)


@dataclass(frozen=True)
class Splits:
    train: list[Example]
    validation: list[Example]


def _evaluate(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def arithmetic_splits(spec: SyntheticArithmeticData) -> Splits:
    """Disjoint train / validation problems: no validation question is ever trained on.

    Distinct problems are shuffled with the seed; the first `validation_size` are held out,
    and training draws `train_size` examples (with repetition if the space is small) from
    the rest.
    """
    values = range(spec.min_value, spec.max_value + 1)
    right = spec.right_values or values
    problems = [(a, op, b) for op in spec.operations for a, b in itertools.product(values, right)]
    rng = random.Random(spec.seed)
    rng.shuffle(problems)
    if len(problems) <= spec.validation_size:
        raise OrbitError(
            f"data: only {len(problems)} distinct problems in [{spec.min_value}, {spec.max_value}]; "
            f"validation_size {spec.validation_size} leaves none to train on"
        )
    held_out, pool = problems[: spec.validation_size], problems[spec.validation_size :]

    def example(problem: tuple[int, str, int]) -> Example:
        a, op, b = problem
        return Example(prompt=spec.template.format(question=f"{a}{op}{b}"), answer=str(_evaluate(a, op, b)))

    train = [example(pool[i % len(pool)]) for i in range(spec.train_size)]
    return Splits(train=train, validation=[example(p) for p in held_out])


def _read_rows(path: Path, kind: str) -> list[dict]:
    if not path.is_file():
        raise OrbitError(f"data.path {path}: no such file")
    if kind == "jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise OrbitError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
        return rows
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OrbitError("data.type parquet needs pyarrow (pip install pyarrow)") from None
    return pq.read_table(path).to_pylist()


def _to_example(row: dict, spec: FileData, where: str) -> Example:
    if spec.prompt_field not in row and spec.template is None:
        raise OrbitError(f"{where}: no field {spec.prompt_field!r} (data.prompt_field)")
    try:
        prompt = spec.template.format(**row) if spec.template else str(row[spec.prompt_field])
    except KeyError as exc:
        raise OrbitError(f"{where}: data.template uses {exc} which the row lacks") from None
    answer = row.get(spec.answer_field)
    return Example(prompt=prompt, answer=None if answer is None else str(answer))


def file_splits(spec: FileData) -> Splits:
    rows = _read_rows(Path(spec.path), spec.type)
    examples = [_to_example(r, spec, f"{spec.path} row {i + 1}") for i, r in enumerate(rows)]
    if spec.validation_path:
        val_rows = _read_rows(Path(spec.validation_path), spec.type)
        validation = [_to_example(r, spec, f"{spec.validation_path} row {i + 1}") for i, r in enumerate(val_rows)]
        return Splits(train=examples, validation=validation)
    if len(examples) <= spec.validation_size:
        raise OrbitError(f"{spec.path}: {len(examples)} rows; validation_size {spec.validation_size} leaves none to train on")
    return Splits(train=examples[: -spec.validation_size], validation=examples[-spec.validation_size :])


def load_splits(spec, environment=None) -> Splits:
    """The train / validation examples of a job's `data` section (ENVIRONMENT: the job's, for data.type environment)."""
    if isinstance(spec, EnvironmentData):
        return environment.splits(spec.validation_size, spec.seed)
    if isinstance(spec, BfclData):
        from orbit_runtime.environments.bfcl import bfcl_splits

        return bfcl_splits(spec.categories, spec.validation_size, spec.seed)
    if isinstance(spec, SyntheticArithmeticData):
        return arithmetic_splits(spec)
    if isinstance(spec, HumanEvalData):
        return humaneval_splits(spec)
    if isinstance(spec, SyntheticCodeData):
        return synthetic_code_splits(spec)
    return file_splits(spec)
