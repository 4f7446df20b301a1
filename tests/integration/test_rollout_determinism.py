"""The rollout repeats itself: the same request gets the same tokens and the same log-probs.

Exact resume (test_checkpoint_resume.py) and comparable runs rest on it: the learner's loss reads
vLLM's log-probs (importance weights, mismatch), and Adam turns a 1e-4 difference in a weak
gradient into a visible one in the adapter. Measured on 2 cores: with vLLM's CPU worker on both
(VLLM_CPU_NUM_OF_RESERVED_CPU=0) the same request got one of two log-prob sums, 5e-4 nats
apart, from call to call; on one thread (vLLM's own reservation, Orbit's default) it repeats.
Each request here is alone in the engine (one prompt, one sample, sent one after another):
requests that share an engine step get log-probs that depend on their batch-mates, which is
timing (test_checkpoint_resume.EXACT), not what this test is about.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 9, 13, 17, 21, 30 + i] for i in range(4)]
REPEATS = 6


def _fingerprint(groups) -> list[tuple]:
    return [(tuple(c.token_ids), tuple(c.logprobs)) for group in groups for c in group]


def test_the_same_request_gets_the_same_logprobs(rollout_client):
    def sample():  # each prompt alone: one request, one sample, its own seed
        return _fingerprint([rollout_client.generate([p], n=1, max_tokens=6, seed=[100 + i])[0] for i, p in enumerate(PROMPTS)])

    sample()  # a first round warms the engine up (run alone, this test has a fresh server)
    first = sample()
    assert len(first) == len(PROMPTS)
    for _ in range(REPEATS - 1):
        again = sample()
        assert [tokens for tokens, _ in again] == [tokens for tokens, _ in first]
        gaps = [abs(a - b) for (_, x), (_, y) in zip(again, first, strict=True) for a, b in zip(x, y, strict=True)]
        assert max(gaps) == 0.0, f"log-probs moved by up to {max(gaps):.2e} nats between two equal requests"
