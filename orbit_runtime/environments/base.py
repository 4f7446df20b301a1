"""The environment interface the learner drives through an episode.

An episode: `reset(example)` gives the opening messages; then, turn by turn, the model writes
an assistant message and `step(state, message)` answers with the environment's messages (tool
results, a user's reply), whether the episode is over, and (when it is) the environment's own
reward, if it has one. The learner keeps the token ids; an environment sees and writes only
messages (OpenAI chat format: dicts with `role` and `content`, assistant `tool_calls`).

Environments are called from several threads at once (one per episode in flight): keep
per-episode state in `EpisodeState.data`, not on the environment.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from orbit_runtime.data.datasets import Example

Message = dict[str, Any]


@dataclass
class EpisodeState:
    """One episode's conversation so far (opening messages included) and the environment's own notes."""

    example: Example
    messages: list[Message]
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvReply:
    """What the environment answers to a model turn."""

    messages: list[Message]  # appended to the conversation (and, as tokens, to the episode) unless done
    done: bool
    reward: float | None = None  # the environment's score of the whole episode (given when done)


class Environment(ABC):
    """A multi-turn counterpart of the model: tools, a simulated user, a game."""

    def tools(self, example: Example) -> list[dict] | None:
        """JSON schemas (OpenAI `tools` format) the chat template shows the model; None: no tools."""
        return None

    @abstractmethod
    def reset(self, example: Example) -> EpisodeState:
        """The opening conversation for EXAMPLE (it ends with a user or tool message)."""

    @abstractmethod
    def step(self, state: EpisodeState, message: Message) -> EnvReply:
        """The environment's answer to the model's MESSAGE (already appended to state.messages)."""

    def score(self, state: EpisodeState) -> float | None:
        """The environment's reward of a finished or truncated episode (None: it has none; `rewards` score it)."""
        return state.data.get("reward")
