"""Environments written for PrimeIntellect's `verifiers` (0.4, `verifiers.v1`) inside Orbit's loop.

verifiers runs a rollout through its own agent harness, which calls the model over an OpenAI
API and so sees text. Orbit keeps token ids instead, so the adapter uses the environment's
parts and leaves its harness out:
- the Taskset's tasks are the examples (their prompt, system prompt and data);
- each task's Toolsets are the tools: their schemas as the MCP server registers them (named
  `<prefix>_<tool>`, as verifiers' chat loop names them) and their `@vf.tool` methods, called in
  process when the model writes a <tool_call>; one Toolset instance per episode, as verifiers
  makes one per rollout;
- the task's rubric (`@vf.reward` functions, `Task.score`) scores the finished conversation,
  given to it as a verifiers Trace; the score is the `environment` reward.
Async tools and rubrics are bounded in time (environment.tool_timeout_s, SCORE_TIMEOUT_S); a
synchronous tool runs in the episode's thread, unbounded (as verifiers itself runs it).
Not supported: tasks whose turns come from an `Env.run()` (simulated users, games) or from a
harness program, rewards that need a sandbox runtime, and LLM judges (they call a model endpoint).

verifiers is async; its coroutines run on one event loop in a thread of its own, so episodes
running in many threads can share it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import threading
from typing import Any

from orbit_runtime.data.datasets import Example, Splits
from orbit_runtime.environments.base import Environment, EnvReply, EpisodeState, Message
from orbit_runtime.environments.tool_calls import parse_tool_calls
from orbit_runtime.environments.tools import answer_call
from orbit_runtime.errors import OrbitError

SCORE_TIMEOUT_S = 120.0  # one rubric scoring, one tool listing


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise OrbitError(f"environment.type verifiers: the verifiers package is not installed ({exc}); "
                         "pip install 'orbit[verifiers]'") from None  # fmt: skip
    return vf


class _Loop:
    """One asyncio loop in a daemon thread; `run(coro)` from any thread waits for the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="verifiers-loop", daemon=True).start()

    def run(self, coroutine, timeout_s: float):
        """The coroutine's result; TimeoutError (the coroutine cancelled) after TIMEOUT_S."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise


class VerifiersEnvironment(Environment):
    """A verifiers Taskset (an instance, e.g. `MyTaskset(MyConfig())`) as an Orbit Environment."""

    def __init__(self, taskset: Any, tool_timeout_s: float = 10.0) -> None:
        vf = _verifiers()
        if not isinstance(taskset, vf.Taskset):
            raise OrbitError(f"environment.load returned a {type(taskset).__name__}, not a verifiers.v1 Taskset instance")
        self.vf = vf
        self.tasks = list(taskset)
        if not self.tasks:
            raise OrbitError("environment.load: the verifiers Taskset has no tasks")
        self.tool_timeout_s = tool_timeout_s
        self._loop = _Loop()
        self._schemas: dict[type, list[dict]] = {}
        self._schema_lock = threading.Lock()

    # ---- the data ------------------------------------------------------------------------
    def splits(self, validation_size: int, seed: int) -> Splits:
        """The tasks as examples, shuffled with SEED; the last VALIDATION_SIZE are held out."""
        if len(self.tasks) <= validation_size:
            raise OrbitError(f"data.validation_size {validation_size}: the verifiers Taskset has only {len(self.tasks)} tasks")
        order = list(range(len(self.tasks)))
        random.Random(seed).shuffle(order)
        examples = [self._example(i) for i in order]
        return Splits(train=examples[:-validation_size], validation=examples[-validation_size:])

    def _example(self, index: int) -> Example:
        data = self.tasks[index].data
        prompt = data.prompt if isinstance(data.prompt, str) else json.dumps([_plain(m) for m in data.prompt or []])
        answer = getattr(data, "answer", None)
        return Example(prompt=prompt, answer=None if answer is None else str(answer), source=index)

    # ---- the episode ---------------------------------------------------------------------
    def _task(self, example: Example):
        if not isinstance(example.source, int):
            raise OrbitError("a verifiers environment runs its own tasks: set data.type to environment")
        return self.tasks[example.source]

    def _toolsets(self, task) -> list:
        return list(type(task).toolsets(task.config)) if hasattr(task, "config") else []

    def tools(self, example: Example) -> list[dict] | None:
        schemas = [s for toolset in self._toolsets(self._task(example)) for s in self._toolset_schemas(toolset)]
        return schemas or None

    def _toolset_schemas(self, toolset) -> list[dict]:
        with self._schema_lock:
            if type(toolset) not in self._schemas:
                self._schemas[type(toolset)] = self._loop.run(_list_tools(toolset), SCORE_TIMEOUT_S)
            return self._schemas[type(toolset)]

    def reset(self, example: Example) -> EpisodeState:
        task = self._task(example)
        data = task.data
        messages: list[Message] = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [_plain(m) for m in data.prompt or []]
        methods = {}
        for toolset in self._toolsets(task):
            for schema in self._toolset_schemas(toolset):
                name = schema["function"]["name"]
                methods[name] = getattr(toolset, name.removeprefix(f"{toolset.server_name}_"))
        return EpisodeState(example, messages, {"task": task, "tools": methods, "calls": 0})

    def step(self, state: EpisodeState, message: Message) -> EnvReply:
        _, calls = parse_tool_calls(message.get("content") or "")
        if not calls:
            return EnvReply([], done=True)
        replies = []
        for call in calls:
            call_id = f"call_{state.data['calls']}"
            state.data["calls"] += 1
            message.setdefault("orbit_call_ids", []).append(call_id)
            replies.append({"role": "tool", "tool_call_id": call_id, "name": call.name, "content": self._call(state, call)})
        return EnvReply(replies, done=False)

    def _call(self, state: EpisodeState, call) -> str:
        def invoke(method, arguments):
            result = method(**arguments)
            return self._loop.run(_awaited(result), self.tool_timeout_s) if inspect.isawaitable(result) else result

        return answer_call(call, state.data["tools"].get(call.name), invoke, self.tool_timeout_s)

    def score(self, state: EpisodeState) -> float | None:
        """The task's rubric on the conversation (verifiers' Task.score on a Trace of it)."""
        task = state.data["task"]
        trace = self._trace(task, state.messages, self.tools(state.example))
        self._loop.run(task.score(trace), SCORE_TIMEOUT_S)  # a rubric that hangs fails its episode, not the run
        state.data["rewards"] = {name: reward.score for name, reward in (trace.rewards or {}).items()}
        return float(trace.reward) if trace.reward is not None else None

    def _trace(self, task, messages: list[Message], tools: list[dict] | None):
        from verifiers.v1.graph import prepare_turn

        vf = self.vf
        trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                         agent=vf.AgentInfo(config=vf.AgentConfig(model="orbit-policy")))  # fmt: skip
        declared = [vf.Tool(name=s["function"]["name"], description=s["function"].get("description", ""),
                            parameters=s["function"]["parameters"]) for s in tools or []]  # fmt: skip
        context: list = []
        for message in messages:
            typed = self._typed(message)
            if isinstance(typed, vf.AssistantMessage):  # each model turn is one sampled turn of the trace
                response = vf.Response(id="orbit", created=0, model="orbit-policy", message=typed, finish_reason="stop")
                prepare_turn(trace, context, declared or None).commit(response)
            context.append(typed)
        return trace

    def _typed(self, message: Message):
        vf = self.vf
        role = message["role"]
        if role == "assistant":
            text, calls = parse_tool_calls(message.get("content") or "")
            ids = message.get("orbit_call_ids", [])
            tool_calls = [vf.ToolCall(id=ids[i] if i < len(ids) else f"call_x{i}", name=c.name or "invalid",
                                      arguments=json.dumps(c.arguments)) for i, c in enumerate(calls)]  # fmt: skip
            return vf.AssistantMessage(content=text or None, tool_calls=tool_calls or None)
        if role == "tool":
            return vf.ToolMessage(tool_call_id=message.get("tool_call_id", "call_x"), name=message.get("name"),
                                  content=message["content"])  # fmt: skip
        if role == "system":
            return vf.SystemMessage(content=message["content"])
        return vf.UserMessage(content=message["content"])


async def _list_tools(toolset) -> list[dict]:
    """OpenAI tool schemas of TOOLSET as verifiers' MCP server registers them (name: <server_name>_<tool>)."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(toolset.server_name)
    toolset.register(server)
    return [{"type": "function", "function": {"name": f"{toolset.server_name}_{tool.name}", "description": tool.description or "",
             "parameters": tool.input_schema}} for tool in await server.list_tools()]  # fmt: skip


async def _awaited(awaitable):
    return await awaitable


def _plain(message) -> Message:
    """A verifiers message (pydantic) or dict as a plain chat dict."""
    return message if isinstance(message, dict) else message.model_dump(exclude_none=True)
