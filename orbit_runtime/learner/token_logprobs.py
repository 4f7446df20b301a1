"""Log-probs of chosen tokens from final hidden states, a chunk of tokens at a time.

The learner needs log p(token) only at the positions it trains on (a completion's tokens),
never the full [tokens, vocab] fp32 log-softmax: at a 160k vocabulary and a 16k-token
micro-batch that tensor alone is ~10 GB. Here the LM head, the temperature and the
normaliser run on LOGPROB_CHUNK_TOKENS positions at a time; under autograd each chunk is
checkpointed, so backward recomputes its logits instead of keeping them, and at most one
chunk's logits are alive in forward or backward.

The arithmetic is vLLM's sampler's (`processed_logprobs`): logits in the model dtype, cast
to fp32, divided by the temperature, normalised in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from orbit_runtime.config.learner import LOGPROB_CHUNK_TOKENS


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: Callable, temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> torch.Tensor:
    """log softmax(head(HIDDEN) / T)[TARGETS]: hidden [N, H], targets [N] -> [N] float32, in chunks."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    grad = torch.is_grad_enabled()
    pieces = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if grad:  # keep only the chunk's hidden states for backward, recompute its logits there
            pieces.append(checkpoint(_chunk_logprobs, h, t, head, temperature, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(h, t, head, temperature))
    if not pieces:  # no positions: an empty row that stays in the graph (a loss over it still backpropagates)
        return hidden[:, 0].float()
    return torch.cat(pieces)
