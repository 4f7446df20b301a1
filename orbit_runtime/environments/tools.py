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
from dataclasses import dataclass
from typing import Any

from orbit_runtime.data.datasets import Example
from orbit_runtime.dotted_path import load_callable
from orbit_runtime.environments.base import Environment, EnvReply, EpisodeState, Message
from orbit_runtime.environments.calculator import calculator
from orbit_runtime.environments.python_tool import python
from orbit_runtime.environments.tool_calls import ToolCall, parse_tool_calls
from orbit_runtime.errors import OrbitError
from orbit_runtime.observability import environment_metrics

BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator, "python": python}
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
    if name == "python":  # a job that cannot sandbox code fails at its start, naming what is missing
        from orbit_runtime.sandbox.bwrap import SandboxUnavailable, check_sandbox_tools

        try:
            check_sandbox_tools()
        except SandboxUnavailable as exc:
            raise OrbitError(f"environment.tools: python: {exc}") from None
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

    def _answer(self, call: ToolCall) -> Message:
        tool = self.by_name.get(call.name)
        content = answer_call(call, tool.function if tool else None,
                              lambda function, arguments: self._pool.submit(function, **arguments).result(timeout=self.timeout_s),
                              self.timeout_s, tools_hint=f"; tools: {', '.join(self.by_name)}", limit=MAX_RESULT)  # fmt: skip
        return {"role": "tool", "name": call.name or "error", "content": content}


def answer_call(call: ToolCall, function: Callable | None, invoke: Callable[[Callable, dict], Any], timeout_s: float,
                tools_hint: str = "", limit: int | None = None) -> str:  # fmt: skip
    """The text answering CALL, counted in orbit_tool_calls_total by status. INVOKE(function, arguments)
    runs it, raising TimeoutError after TIMEOUT_S (a thread keeps running: a tool that can hang should
    bound itself). Every failure is an answer for the model, never an error of the run."""
    if call.error:
        return _counted("", "malformed", f"error: {call.error}")
    if function is None:
        return _counted("", "unknown_tool", f"error: no tool {call.name!r}{tools_hint}")
    try:
        result = invoke(function, call.arguments)
    except TimeoutError:
        return _counted(call.name, "timeout", f"error: {call.name} took longer than {timeout_s:g}s")
    except TypeError as exc:
        return _counted(call.name, "bad_arguments", f"error: bad arguments ({exc})")
    except Exception as exc:  # noqa: BLE001 - a tool's failure is an answer to the model
        return _counted(call.name, "error", f"error: {exc}")
    text = result if isinstance(result, str) else json.dumps(result, default=str)
    return _counted(call.name, "ok", text[:limit])


def _counted(tool: str, status: str, content: str) -> str:
    environment_metrics.TOOL_CALLS.labels(tool, status).inc()
    return content
