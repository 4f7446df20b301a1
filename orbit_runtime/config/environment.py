"""Settings for multi-turn episodes: the environment the model talks to, and the episode limits.

No `environment` section: every sample is one completion (single turn). With one, every sample
is an episode: the model's turns, the environment's replies (tool results, user turns) in
between, all kept as token ids; only the model's tokens are trained on.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

BUILTIN_TOOLS = ("calculator", "python")


class EnvironmentData(BaseModel):
    """The environment's own tasks as the data (a verifiers Taskset's)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["environment"] = Field(description="environment: the tasks of the job's environment (type verifiers).")
    validation_size: int = Field(16, ge=1, description="Tasks held out (the last ones after a seeded shuffle).")
    seed: int = Field(0, description="Seed of the train / validation split.")


class BfclData(BaseModel):
    """The Berkeley Function Calling Leaderboard's single-turn tasks, read from the installed bfcl-eval package's files."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["bfcl"] = Field(description="bfcl: BFCL tasks (with environment.type bfcl).")
    categories: list[Literal["simple_python", "multiple", "parallel", "parallel_multiple"]] = Field(
        default_factory=lambda: ["simple_python"], min_length=1, description="BFCL categories (single-turn, AST-checked)."
    )
    validation_size: int = Field(64, ge=1, description="Tasks held out (the last ones after a seeded shuffle).")
    seed: int = Field(0, description="Seed of the train / validation split.")


class EnvironmentSpec(BaseModel):
    """The environment of a multi-turn job and its limits."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["tools", "verifiers", "python", "bfcl"] = Field(
        description=(
            "bfcl: the Berkeley Function Calling Leaderboard's single-turn tasks (with data.type bfcl): the model "
            "calls the task's functions, the calls are scored against BFCL's possible answers (the `environment` reward). "
            "tools: the model calls the listed tools (Hermes/Qwen <tool_call> JSON in the chat template) until it "
            "answers without a call; the answer is scored by `rewards`. verifiers: an environment written for "
            "PrimeIntellect's `verifiers` library (`load` returns it), scored by its rubric (the `environment` reward). "
            "python: an Orbit Environment of your own (`load` returns it)."
        )
    )
    tools: list[str] = Field(
        default_factory=list,
        description=(
            "type tools: built-ins (calculator: arithmetic on numbers; python: runs a program in the code sandbox, bwrap, and "
            "answers with what it printed) "
            "or 'module:function' paths to Python functions with type hints and a Google-style docstring (their JSON "
            "schema is derived from them)."
        ),
    )
    load: str | None = Field(
        None, description="type verifiers or python: 'module:callable' returning the environment (called with `kwargs`)."
    )
    kwargs: dict = Field(default_factory=dict, description="Keyword arguments for `load`.")
    system_prompt: str | None = Field(None, description="type tools: a system message before each prompt.")
    max_turns: int = Field(4, ge=1, le=64, description="Most model turns per episode; an episode still going after them is truncated.")
    max_tokens: int = Field(
        256, ge=1, description="Most tokens per episode after its prompt (the model's and the environment's); each turn "
        "also stops at rollout.max_tokens. An episode that reaches it is truncated (rollout.truncated applies)."
    )
    concurrency: int = Field(32, ge=1, le=100, description="Episodes in flight at once (concurrent requests to vLLM; at most "
                             "100, the rollout client's connection pool).")
    tool_timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one tool call; a tool that runs longer answers with an error.")

    @field_validator("load")
    @classmethod
    def validate_load(cls, load: str | None) -> str | None:
        if load is not None and (":" not in load or not all(load.partition(":")[::2])):
            raise ValueError(f"{load!r}: expected 'module:callable'")
        return load

    @field_validator("tools")
    @classmethod
    def validate_tools(cls, tools: list[str]) -> list[str]:
        for name in tools:
            if name not in BUILTIN_TOOLS and ":" not in name:
                raise ValueError(f"{name!r}: not a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor 'module:function'")
        if len(set(tools)) != len(tools):
            raise ValueError("a tool is listed twice")
        return tools

    def check(self) -> None:
        """Cross-field rules (raised as ValueError, which the job spec names as `environment`)."""
        if self.type == "tools" and not self.tools:
            raise ValueError("type tools needs at least one entry in tools")
        if self.type != "tools" and self.tools:
            raise ValueError(f"tools are for type tools; a {self.type} environment brings its own")
        if self.type in ("tools", "bfcl") and (self.load or self.kwargs):
            raise ValueError(f"load and kwargs are for types verifiers and python, not {self.type}")
        if self.type != "tools" and self.system_prompt is not None:
            raise ValueError(f"system_prompt is for type tools; a {self.type} environment brings its own prompts")
        if self.type in ("verifiers", "python") and not self.load:
            raise ValueError(f"type {self.type} needs load: 'module:callable' returning the environment")
