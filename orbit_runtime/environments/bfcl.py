"""The Berkeley Function Calling Leaderboard's single-turn categories as tool-calling tasks.

The data is read from the files the `bfcl-eval` package ships (installed with --no-deps: its
own pins, numpy 1.26 among them, conflict with vLLM's; nothing of it is imported, only its data
files are read). Each task: a user question, the functions the model may call (their BFCL
schemas, shown through the chat template's tools), and the possible answers. The model answers
with its calls in one turn; nothing is executed. The reward (the `environment` reward) is 1
when the calls match a possible answer, a simplification of BFCL's AST checker: the same
functions (in any order for the parallel categories), every argument given among its allowed
values (numbers compared as numbers, strings stripped and case-folded), and every argument the
answer requires present (an allowed value of "" marks one as optional).

The multi-turn categories need BFCL's stateful tool classes (its file system, trading bot, ...)
and its state checker; they are not covered here.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
from pathlib import Path

from orbit_runtime.data.datasets import Example, Splits
from orbit_runtime.environments.base import Environment, EnvReply, EpisodeState, Message
from orbit_runtime.environments.tool_calls import ToolCall, parse_tool_calls
from orbit_runtime.errors import OrbitError

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
DISTRIBUTION = "bfcl-eval"


def _data_dir() -> Path:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise OrbitError("data.type bfcl: the bfcl-eval package is not installed (pip install --no-deps bfcl-eval==2026.3.23)") from None
    return Path(str(dist.locate_file("bfcl_eval/data")))


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise OrbitError(f"data.type bfcl: cannot read {path}: {exc}") from None


def bfcl_examples(categories: list[str]) -> list[Example]:
    """Every task of CATEGORIES: the question, its ground truth as the answer (JSON), its functions as the source."""
    data = _data_dir()
    examples = []
    for category in categories:
        answers = {row["id"]: row["ground_truth"] for row in _rows(data / "possible_answer" / f"BFCL_v4_{category}.json")}
        for row in _rows(data / f"BFCL_v4_{category}.json"):
            question = [m for turn in row["question"] for m in turn]
            examples.append(Example(prompt=question[-1]["content"], answer=json.dumps(answers[row["id"]]),
                                    source={"id": row["id"], "messages": question, "functions": row["function"]}))  # fmt: skip
    return examples


def bfcl_splits(categories: list[str], validation_size: int, seed: int) -> Splits:
    examples = bfcl_examples(categories)
    if len(examples) <= validation_size:
        raise OrbitError(f"data.validation_size {validation_size}: the BFCL categories have only {len(examples)} tasks")
    random.Random(seed).shuffle(examples)
    return Splits(train=examples[:-validation_size], validation=examples[-validation_size:])


def openai_schema(function: dict) -> dict:
    """A BFCL function (JSON schema with BFCL's 'dict' type) in OpenAI's tools format."""

    def fix(node):
        if isinstance(node, dict):
            return {k: ("object" if k == "type" and v == "dict" else fix(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    return {"type": "function", "function": fix(function)}


def _same(value, allowed) -> bool:
    if isinstance(allowed, str) and isinstance(value, str):
        return value.strip().casefold() == allowed.strip().casefold()
    if isinstance(allowed, bool) or isinstance(value, bool):
        return value is allowed
    if isinstance(allowed, int | float) and isinstance(value, int | float):
        return float(value) == float(allowed)
    if isinstance(allowed, list) and isinstance(value, list):
        return len(allowed) == len(value) and all(_same(v, a) for v, a in zip(value, allowed, strict=True))
    if isinstance(allowed, dict) and isinstance(value, dict):
        return allowed.keys() == value.keys() and all(_same(value[k], a) for k, a in allowed.items())
    return value == allowed


def call_matches(call: ToolCall, expected: dict) -> bool:
    """Does CALL match one expected call {name: {param: [allowed values]}}?"""
    ((name, params),) = expected.items()
    if call.error or call.name != name or not set(call.arguments) <= set(params):
        return False
    for param, allowed in params.items():
        if param in call.arguments:
            if not any(_same(call.arguments[param], a) for a in allowed):
                return False
        elif "" not in allowed:
            return False
    return True


def calls_match(calls: list[ToolCall], ground_truth: list[dict]) -> bool:
    """Do CALLS match GROUND_TRUTH one to one, in any order? (A matching, not a greedy pass: an
    expected call may allow several values, so the first fit is not always the right one.)"""
    if len(calls) != len(ground_truth):
        return False
    fits = [[j for j, expected in enumerate(ground_truth) if call_matches(call, expected)] for call in calls]

    def assign(i: int, used: frozenset) -> bool:
        return i == len(calls) or any(assign(i + 1, used | {j}) for j in fits[i] if j not in used)

    return assign(0, frozenset())


class BfclEnvironment(Environment):
    """One turn: the model calls the task's functions; the calls are the answer."""

    def _source(self, example: Example) -> dict:
        if not isinstance(example.source, dict) or "functions" not in example.source:
            raise OrbitError("environment.type bfcl runs BFCL's own tasks: set data.type to bfcl")
        return example.source

    def tools(self, example: Example) -> list[dict]:
        return [openai_schema(f) for f in self._source(example)["functions"]]

    def reset(self, example: Example) -> EpisodeState:
        return EpisodeState(example, [dict(m) for m in self._source(example)["messages"]])

    def step(self, state: EpisodeState, message: Message) -> EnvReply:
        _, calls = parse_tool_calls(message.get("content") or "")
        return EnvReply([], done=True, reward=float(calls_match(calls, json.loads(state.example.answer))))
