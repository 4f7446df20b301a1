"""Token ids of an episode's parts, from the tokenizer's chat template, without ever re-rendering
the history.

The opening (system, user, tools) is rendered once, with the generation prompt. Each later
environment turn is rendered as a delta: the template's text for the new messages alone,
obtained from a fixed two-message conversation rendered with and without them, plus what the
template writes after a model turn's end-of-turn token (Qwen: the "\\n" after <|im_end|>).
Those tokens are appended to the ids the model generated, which stay exactly as sampled:
re-tokenizing a re-rendered history can merge or split tokens at the seams and would break
the match between the rollout's and the learner's log-probs.
"""

from __future__ import annotations

from orbit_runtime.environments.base import Message
from orbit_runtime.errors import OrbitError

_BASE: list[Message] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]


class ChatTokens:
    """Opening and environment-turn token ids for one tokenizer."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise OrbitError("environment: multi-turn episodes need a tokenizer with a chat template (the base's has none)")
        self.tokenizer = tokenizer

    def _render(self, messages: list[Message], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def opening(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """The episode's prompt: MESSAGES with TOOLS, ending in the assistant's generation prompt."""
        return self._encode(self._render(messages, tools, True))

    def environment_turn(self, messages: list[Message], tools: list[dict] | None, last_model_token: int) -> list[int]:
        """Ids to append after a model turn that ended with LAST_MODEL_TOKEN: the environment's MESSAGES
        and the next generation prompt."""
        before = self._render(_BASE, tools, False)
        after = self._render([*_BASE, *messages], tools, True)
        if not after.startswith(before):
            raise OrbitError("environment: the chat template renders earlier turns differently once more messages follow, "
                             "so environment turns cannot be appended as tokens")  # fmt: skip
        return self._encode(_turn_tail(before, self.tokenizer.decode([last_model_token])) + after[len(before):])


def _turn_tail(rendered: str, end: str) -> str:
    """What the template writes after a model turn's end token END in RENDERED (Qwen: '\\n' after
    <|im_end|>); '' when END does not occur (the turn ended another way)."""
    cut = rendered.rfind(end) if end else -1
    return rendered[cut + len(end) :] if cut >= 0 else ""
