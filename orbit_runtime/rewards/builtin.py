"""Built-in rewards. The contract (as in TRL): `fn(completions, **kwargs) -> list[float | None]`.

kwargs always include `prompts` and `answers` (lists aligned with `completions`) plus the
reward's own configured kwargs. None means "not applicable" and counts as 0.

>>> exact_match(["so \\\\boxed{12}", "it is 7", "no idea"], answers=["12", "8", "3"])
[1.0, 0.0, 0.0]
"""

from __future__ import annotations

import re
from typing import Any

from orbit_runtime.rewards.code import code_tests

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str, require_boxed: bool = False) -> str | None:
    """The content of the last \\boxed{...}, else (unless REQUIRE_BOXED) the last number in the text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    if require_boxed:
        return None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a.strip() == b.strip()


def exact_match(
    completions: list[str], *, answers: list[str | None], require_boxed: bool = False, **_: Any
) -> list[float | None]:
    """1.0 when the extracted final answer equals the reference answer, else 0.0.

    With REQUIRE_BOXED only a \\boxed{...} answer counts (no fallback to the last number).
    """
    out: list[float | None] = []
    for text, answer in zip(completions, answers, strict=True):
        if answer is None:
            out.append(None)
            continue
        got = extract_answer(text, require_boxed)
        out.append(1.0 if got is not None and _same(got, str(answer)) else 0.0)
    return out


def prefix_match(
    completions: list[str], *, answers: list[str | None], require_boxed: bool = True, **_: Any
) -> list[float | None]:
    """Partial credit: the share of the answer's leading characters reproduced, penalising
    extra length: common_prefix / max(len(answer), len(extracted)). Dense where exact_match is
    sparse, so a group of samples is rarely all-zero.
    """
    out: list[float | None] = []
    for text, answer in zip(completions, answers, strict=True):
        if answer is None:
            out.append(None)
            continue
        got, want = extract_answer(text, require_boxed) or "", str(answer)
        common = 0
        for a, b in zip(got, want, strict=False):  # unequal lengths: compare the common part
            if a != b:
                break
            common += 1
        out.append(common / max(len(got), len(want), 1))
    return out


def boxed_format(completions: list[str], **_: Any) -> list[float | None]:
    """1.0 when the completion is exactly one \\boxed{...} answer (surrounding whitespace allowed)."""
    return [1.0 if _BOXED.fullmatch(text.strip()) else 0.0 for text in completions]


def regex(completions: list[str], *, pattern: str, **_: Any) -> list[float | None]:
    """1.0 when PATTERN (Python re) matches somewhere in the completion."""
    compiled = re.compile(pattern)
    return [1.0 if compiled.search(text) else 0.0 for text in completions]


# code_tests runs programs in a sandbox: orbit_runtime/rewards/code.py
def environment(completions: list[str], *, environment_rewards: list[float | None] | None = None, **_: Any) -> list[float | None]:
    """The episode's reward as its environment scored it (a verifiers rubric, an Orbit Environment's
    `score`); only for jobs with an environment section."""
    if environment_rewards is None:
        raise ValueError("the environment reward needs episodes (a job with an environment section)")
    return list(environment_rewards)


BUILTINS = {"exact_match": exact_match, "environment": environment, "prefix_match": prefix_match, "boxed_format": boxed_format, "regex": regex,
            "code_tests": code_tests}  # fmt: skip
