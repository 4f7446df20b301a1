"""Which modules of a checkpoint stay 16-bit: the one rule `orbit quantize` applies and
`orbit plan` predicts (no torch here, so the planner and the operator can use it)."""

from __future__ import annotations

import re

# Embeddings, the LM head and MoE routers stay 16-bit; every other linear becomes INT4.
DEFAULT_IGNORE = (
    "lm_head",
    "re:.*embed_tokens$",
    "re:.*mlp\\.gate$",  # Qwen and DeepSeek MoE routers
    "re:.*shared_expert_gate$",
    "re:.*block_sparse_moe\\.gate$",  # Mixtral router
)


def matches_any(module_name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """compressed-tensors ignore semantics: `re:REGEX` (re.match) or an exact module name.

    A plain name also matches as the last dotted component(s), so `lm_head` or
    `mlp.gate` match in every layer.
    """
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module_name):
                return True
        elif module_name == pattern or module_name.endswith("." + pattern):
            return True
    return False
