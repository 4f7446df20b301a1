"""Token ids of an episode's parts, from the tokenizer's chat template, without ever re-rendering
the history.

The opening (system, user, tools) is rendered once, with the generation prompt. Each later
environment turn is rendered as a delta: a fixed two-message conversation (a user turn, an
assistant turn holding a sentinel) is rendered followed by the new messages and the generation
prompt, and the delta is everything after the assistant turn's end-of-turn marker (Qwen: the
"\\n<|im_start|>tool..." after <|im_end|>). Templates that change earlier turns once more
follow (Qwen3 drops the empty <think> block of an assistant turn that is no longer the last)
do not disturb this: only the text after the marker is used. Those ids are appended to the ids
the model generated, which stay exactly as sampled: re-tokenizing a re-rendered history can
merge or split tokens at the seams and would break the match between the rollout's and the
learner's log-probs. A model turn that stopped on another token than the end-of-turn marker
(an extra EOS id of generation_config) gets the marker written after it, as environment
tokens, so the next turn starts where the template says turns start.
"""

from __future__ import annotations

from orbit_runtime.environments.base import Message
from orbit_runtime.errors import OrbitError

SENTINEL = "orbit-turn-sentinel-5c1e"
_BASE: list[Message] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]


class ChatTokens:
    """Opening and environment-turn token ids for one tokenizer."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise OrbitError("environment: multi-turn episodes need a tokenizer with a chat template (the base's has none)")
        self.tokenizer = tokenizer
        self.end_of_turn = tokenizer.eos_token  # the template's end-of-turn marker (Qwen: <|im_end|>)
        if not self.end_of_turn:
            raise OrbitError("environment: the tokenizer has no eos_token, so a model turn's end cannot be found in its template")
        self.end_of_turn_ids = tokenizer.encode(self.end_of_turn, add_special_tokens=False)
        self._delta_text([{"role": "user", "content": "probe"}], None)  # a template this cannot work with fails here, not per step

    def _render(self, messages: list[Message], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def opening(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """The episode's prompt: MESSAGES with TOOLS, ending in the assistant's generation prompt."""
        return self._encode(self._render(messages, tools, True))

    def _delta_text(self, messages: list[Message], tools: list[dict] | None) -> str:
        after = self._render([*_BASE, *messages], tools, True)
        start = after.find(SENTINEL)
        end = after.find(self.end_of_turn, start) if start >= 0 else -1
        if end < 0:
            raise OrbitError(f"environment: the chat template does not close an assistant turn with {self.end_of_turn!r} "
                             "(the tokenizer's eos_token), so environment turns cannot be appended as tokens")  # fmt: skip
        return after[end + len(self.end_of_turn) :]

    def environment_turn(self, messages: list[Message], tools: list[dict] | None, model_turn: list[int]) -> list[int]:
        """Ids to append after MODEL_TURN (as generated): the end-of-turn marker if the model stopped
        otherwise, the environment's MESSAGES and the next generation prompt."""
        closed = model_turn[-len(self.end_of_turn_ids) :] == self.end_of_turn_ids
        return ([] if closed else list(self.end_of_turn_ids)) + self._encode(self._delta_text(messages, tools))
