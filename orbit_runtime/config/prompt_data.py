"""Prompt data as the job spec names it: generated arithmetic, or a local JSONL/Parquet file.
(Code tasks are in code_data.py, environments' tasks in environment.py.)"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SyntheticArithmeticData(BaseModel):
    """Generated `a op b` problems; the answer is checked exactly."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["synthetic_arithmetic"] = Field(
        "synthetic_arithmetic", description="synthetic_arithmetic, jsonl, parquet, humaneval or synthetic_code: which kind of data (and fields) this is."
    )
    operations: list[Literal["+", "-", "*"]] = Field(
        default_factory=lambda: ["+"], min_length=1, description="Operators drawn from (+, -, *)."
    )
    min_value: int = Field(0, description="Operands are drawn from [min_value, max_value].")
    max_value: int = Field(9, description="Operands are drawn from [min_value, max_value].")
    right_values: list[int] | None = Field(
        None, min_length=1, description="If set, the right operand takes only these values (e.g. [10] for 'n*10')."
    )
    train_size: int = Field(2000, ge=1, description="Training problems generated.")
    validation_size: int = Field(64, ge=1, description="Held-out problems (or rows).")
    seed: int = Field(0, description="Seed of the generated problems.")
    template: str = Field("What is {question}?", description="Prompt text; {question} is replaced by e.g. '3+4'.")

    @model_validator(mode="after")
    def validate_range(self) -> SyntheticArithmeticData:
        if self.max_value < self.min_value:
            raise ValueError(f"max_value ({self.max_value}) must be >= min_value ({self.min_value})")
        return self


class FileData(BaseModel):
    """Prompts from a local JSONL or Parquet file."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["jsonl", "parquet"] = Field(description="The file's format.")
    path: str = Field(description="The prompts file (in a cluster: relative to the base's PVC).")
    validation_path: str | None = Field(None, description="Held-out prompts; default: the last validation_size rows of path.")
    validation_size: int = Field(64, ge=1, description="Held-out problems (or rows).")
    prompt_field: str = Field("prompt", description="The row's field holding the prompt.")
    answer_field: str = Field("answer", description="The row's field holding the reference answer.")
    template: str | None = Field(None, description="Python format string over the row's fields; default: the prompt field as is.")
