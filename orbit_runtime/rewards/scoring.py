"""Turn completions into rewards with the configured functions. A reward that raises on a
few samples does not stop training: those samples get 0 and are counted. When it raises on
more than its `max_error_fraction` of a step's samples, the step fails with RewardsFailed
naming it: a reward that mostly fails would otherwise train on zeros."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orbit_runtime.config.spec import RewardSpec
from orbit_runtime.dotted_path import load_callable
from orbit_runtime.errors import OrbitError
from orbit_runtime.rewards.builtin import BUILTINS

log = logging.getLogger(__name__)
RewardFn = Callable[..., Any]


def load_reward_function(name: str) -> RewardFn:
    """A built-in by name, or `package.module:callable` / `package.module.callable`."""
    if name in BUILTINS:
        return BUILTINS[name]
    path = name
    if ":" not in name:
        module_name, _, attr = name.rpartition(".")
        path = f"{module_name}:{attr}" if module_name and attr else name
    if ":" not in path:
        raise OrbitError(f"rewards.function {name!r}: not a built-in ({', '.join(BUILTINS)}) nor 'module:callable'")
    return load_callable(path, "rewards.function")


class RewardsFailed(OrbitError):
    """A reward function raised on more than its max_error_fraction of the samples."""


@dataclass
class RewardResult:
    total: list[float]  # weighted sum per sample
    per_function: dict[str, list[float]]
    errors: dict[str, int] = field(default_factory=dict)  # samples that failed, per function


class RewardScorer:
    """Applies every configured reward (sync or async) and sums them with their weights."""

    def __init__(self, specs: list[RewardSpec]) -> None:
        self.specs = specs
        self.functions = [load_reward_function(spec.function) for spec in specs]
        self.last_error: dict[str, str] = {}  # per function: the last exception, for RewardsFailed's message

    def _call(self, fn: RewardFn, kwargs: dict[str, Any], completions: list[str]) -> list[Any]:
        result = fn(completions, **kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
        result = list(result)
        if len(result) != len(completions):
            raise ValueError(f"returned {len(result)} rewards for {len(completions)} completions")
        return result

    def score(self, completions: list[str], prompts: list[str], answers: list[str | None],
              extra: dict[str, list] | None = None) -> RewardResult:  # fmt: skip
        """Every reward of every completion. EXTRA: more per-sample keyword lists (episodes pass
        `environment_rewards` and `transcripts`), given to the functions whose signature takes them."""
        extra = extra or {}
        totals = [0.0] * len(completions)
        per_function: dict[str, list[float]] = {}
        errors: dict[str, int] = {}
        for index, (spec, fn) in enumerate(zip(self.specs, self.functions, strict=True)):
            errors_before = errors.get(spec.function, 0)
            extras = {name: values for name, values in extra.items() if _accepts(fn, name)}
            base_kwargs = {"prompts": prompts, "answers": answers, **extras, **spec.kwargs}
            try:
                values = self._call(fn, base_kwargs, completions)
            except Exception:
                values = self._score_one_by_one(spec, fn, completions, prompts, answers, errors, extras)
            failed = errors.get(spec.function, 0) - errors_before  # this entry's (a function may be listed twice)
            if failed > spec.max_error_fraction * len(completions):
                raise RewardsFailed(
                    f"reward {spec.function} (rewards[{index}]) raised on {failed} of {len(completions)} samples, more than "
                    f"its max_error_fraction {spec.max_error_fraction}; last error: {self.last_error.get(spec.function)}"
                )
            clean = [float(v) if v is not None else 0.0 for v in values]
            per_function[spec.function] = clean
            totals = [t + spec.weight * v for t, v in zip(totals, clean, strict=True)]
        return RewardResult(total=totals, per_function=per_function, errors=errors)

    def _score_one_by_one(self, spec, fn, completions, prompts, answers, errors, extras) -> list[Any]:
        """The batch call raised: isolate the failing samples, give them 0, count them."""
        values: list[Any] = []
        for i, completion in enumerate(completions):
            one = {name: [column[i]] for name, column in extras.items()}
            kwargs = {"prompts": [prompts[i]], "answers": [answers[i]], **one, **spec.kwargs}
            try:
                values.append(self._call(fn, kwargs, [completion])[0])
            except Exception as exc:  # a user's reward must not kill the run
                errors[spec.function] = errors.get(spec.function, 0) + 1
                self.last_error[spec.function] = f"{type(exc).__name__}: {exc}"
                log.warning("reward %s failed on sample %d: %s: %s", spec.function, i, type(exc).__name__, exc)
                values.append(0.0)
        return values


def _accepts(fn: RewardFn, name: str) -> bool:
    """Does FN take the keyword NAME (by name or through **kwargs)?"""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY) for p in parameters)


async def _await(awaitable):
    return await awaitable
