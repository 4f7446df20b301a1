"""Tool calls in the Hermes / Qwen format, as chat templates of those models write them:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "47*38"}}
    </tool_call>

Pure text functions. A malformed call is not an error of the run: it comes back as a call
with `error` set, and the environment answers it with a tool message saying what was wrong,
so the model learns from it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a function name and its arguments, or why it could not be read."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None

    def as_message_part(self, index: int) -> dict:
        """The call in an OpenAI assistant message's `tool_calls` list."""
        return {"id": f"call_{index}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text outside the calls, the calls in order). An opening tag without its closing one is
    one malformed call (the model was cut off or forgot it)."""
    calls: list[ToolCall] = []
    for body in _CALL.findall(text):
        calls.append(_parse_one(body.strip()))
    outside = _CALL.sub("", text)
    if _OPEN in outside:
        calls.append(ToolCall("", {}, error="a <tool_call> without </tool_call>"))
        outside = outside[: outside.index(_OPEN)]
    return outside.strip(), calls


def _parse_one(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except ValueError as exc:
        return ToolCall("", {}, error=f"the tool call is not JSON ({exc.msg})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", {}, error='a tool call is {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return ToolCall(call["name"], {}, error="the arguments are not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], {}, error="the arguments are not a JSON object")
    return ToolCall(call["name"], arguments)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call as the model should write it (compact JSON, as the demo model's warm-up teaches)."""
    return f"{_OPEN}{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}</tool_call>"
