"""Tools as Python callables with JSON schemas, and the environment that runs them.

A tool is a function with type hints and a Google-style docstring; its schema (OpenAI
`tools` format, what chat templates render) is derived by transformers' `get_json_schema`.
The tool environment answers each model turn that calls tools with one `tool` message per
call, and ends the episode at the first turn without a call (its text is the answer that
`rewards` score). A tool that raises, is unknown, gets bad arguments or runs past its time
answers with an error message: the model's mistake is the model's to learn from, never the
run's to crash on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from orbit_runtime.data.datasets import Example
from orbit_runtime.dotted_path import load_callable
from orbit_runtime.environments.base import Environment, EnvReply, EpisodeState, Message
from orbit_runtime.environments.calculator import calculator
from orbit_runtime.environments.tool_calls import parse_tool_calls
from orbit_runtime.errors import OrbitError
from orbit_runtime.observability import environment_metrics

BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator}
MAX_RESULT = 2000  # characters of a tool's answer kept


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, with the schema the chat template shows it."""

    name: str
    schema: dict
    function: Callable

    @classmethod
    def of(cls, function: Callable) -> Tool:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(function)
        except Exception as exc:  # transformers raises its own TypeHintParsingException / DocstringParsingException
            raise OrbitError(f"tool {getattr(function, '__name__', function)!r}: no JSON schema can be derived ({exc})") from None
        schema["function"].pop("return", None)  # not part of OpenAI's tools format
        return cls(schema["function"]["name"], schema, function)


def load_tool(name: str) -> Tool:
    """A built-in tool by name, or 'module:function'."""
    if name in BUILTIN_TOOLS:
        return Tool.of(BUILTIN_TOOLS[name])
    return Tool.of(load_callable(name, "environment.tools"))


class ToolEnvironment(Environment):
    """The model answers the example's prompt, calling TOOLS as often as it likes (within the episode limits)."""

    def __init__(self, tools: list[Tool], system_prompt: str | None = None, timeout_s: float = 10.0, workers: int = 32) -> None:
        self.by_name = {tool.name: tool for tool in tools}
        if len(self.by_name) != len(tools):
            raise OrbitError("environment.tools: two tools have the same name")
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        # one worker per episode in flight. A tool that hangs keeps its thread (Python cannot kill one): the call is
        # answered with a timeout, but a tool that can hang should bound itself (or run in a subprocess)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool")

    def tools(self, example: Example) -> list[dict]:
        return [tool.schema for tool in self.by_name.values()]

    def reset(self, example: Example) -> EpisodeState:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return EpisodeState(example, [*system, {"role": "user", "content": example.prompt}])

    def step(self, state: EpisodeState, message: Message) -> EnvReply:
        _, calls = parse_tool_calls(message.get("content") or "")
        if not calls:
            return EnvReply([], done=True)
        return EnvReply([self._answer(call) for call in calls], done=False)

    def _answer(self, call) -> Message:
        if call.error:
            return _tool_message(call.name or "error", f"error: {call.error}", "malformed")
        tool = self.by_name.get(call.name)
        if tool is None:
            return _tool_message(call.name, f"error: no tool {call.name!r}; tools: {', '.join(self.by_name)}", "unknown_tool")
        future = self._pool.submit(tool.function, **call.arguments)
        try:
            result = future.result(timeout=self.timeout_s)
        except FutureTimeout:  # the thread runs on; a tool that can hang should bound itself
            return _tool_message(call.name, f"error: {call.name} took longer than {self.timeout_s:g}s", "timeout")
        except TypeError as exc:
            return _tool_message(call.name, f"error: bad arguments ({exc})", "bad_arguments")
        except Exception as exc:  # noqa: BLE001 - a tool's failure is an answer to the model
            return _tool_message(call.name, f"error: {exc}", "error")
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        return _tool_message(call.name, text[:MAX_RESULT], "ok")


def _tool_message(name: str, content: str, status: str) -> Message:
    environment_metrics.TOOL_CALLS.labels(name if status not in ("unknown_tool", "malformed") else "", status).inc()
    return {"role": "tool", "name": name, "content": content}
