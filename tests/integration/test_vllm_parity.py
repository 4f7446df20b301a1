"""The core claim, against a real vLLM server (CPU build): on the same INT4 base and the same
LoRA adapter, vLLM and the learner agree on token log-probs, before and after a LoRA update.

fp16, not bf16: bf16's own rounding noise (~5e-2 mean |dlogp|) would hide a real mismatch.
"""

from __future__ import annotations

import random

import pytest
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.model import load_policy
from orbit_runtime.rollout.client import adapter_name

from .conftest import RANK

pytestmark = pytest.mark.vllm
ADAPTER = AdapterSpec(rank=RANK, alpha=16)


@pytest.fixture
def client(rollout_client):
    return rollout_client


@pytest.fixture(scope="module")
def policy(int4_dir):
    policy = load_policy(int4_dir, ADAPTER, dtype="fp16")
    policy.init_adapter_randomly(std=0.02, seed=0)
    return policy


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[97] + [rng.randrange(0, 96) for _ in range(rng.randrange(4, 12))] for _ in range(count)]


def test_learner_matches_vllm_on_sampled_tokens(client, policy, tmp_path):
    name = adapter_name(1)
    client.load_adapter(name, policy.save_adapter(tmp_path / "v1"))
    groups = client.generate(_prompts(8, seed=1), model=name, n=2, max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    completions = [c for group in groups for c in group]
    with torch.no_grad():
        learner = policy.completion_logprobs([(c.prompt_ids, c.token_ids) for c in completions])
    rollout = [torch.tensor(c.logprobs) for c in completions]
    delta = torch.cat([(a - b).abs() for a, b in zip(learner, rollout, strict=True)])
    assert delta.numel() >= 256
    assert delta.mean() < 1e-2, f"mean |dlogp| {delta.mean():.4f}"
    # the adapter changes vLLM's output: parity is not the trivial no-adapter case
    with torch.no_grad(), policy.adapter_disabled():
        base = policy.completion_logprobs([(c.prompt_ids, c.token_ids) for c in completions])
    assert torch.cat([(a - b).abs() for a, b in zip(learner, base, strict=True)]).mean() > 5 * delta.mean()


def test_lora_step_moves_both_engines_identically(client, policy, tmp_path):
    prompt = [97, 86, 84, 70, 83, 0]
    target = [18, 19, 12, 24, 30, 20, 26, 98]
    sequence = prompt + target
    saved = policy.adapter_state()
    try:
        before_name = adapter_name(2)
        client.load_adapter(before_name, policy.save_adapter(tmp_path / "v2"))
        with torch.no_grad():
            learner_before = policy.completion_logprobs([(prompt, target)])[0].float()
        vllm_before = torch.tensor(client.score(sequence, model=before_name)[len(prompt) - 1 :])

        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=5e-3)
        for _ in range(3):  # a few LoRA steps toward the target continuation
            loss = -policy.completion_logprobs([(prompt, target)])[0].float().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        after_name = adapter_name(3)  # a NEW name: reusing one would serve the cached adapter
        client.load_adapter(after_name, policy.save_adapter(tmp_path / "v3"))
        client.unload_adapter(before_name)
        with torch.no_grad():
            learner_after = policy.completion_logprobs([(prompt, target)])[0].float()
        vllm_after = torch.tensor(client.score(sequence, model=after_name)[len(prompt) - 1 :])
    finally:
        policy.load_adapter_state(saved)

    learner_change = learner_after - learner_before
    vllm_change = vllm_after - vllm_before
    assert learner_change.mean() > 0.5, "the update should raise the target's log-prob"
    assert (learner_change - vllm_change).abs().mean() < 2e-2
    assert (learner_after - vllm_after).abs().mean() < 1e-2
    assert before_name not in client.served_models() and after_name in client.served_models()


def test_client_refuses_to_reuse_an_adapter_name(client, policy, tmp_path):
    path = policy.save_adapter(tmp_path / "v4")
    client.load_adapter(adapter_name(4), path)
    with pytest.raises(ValueError, match="used before"):
        client.load_adapter(adapter_name(4), path)


def test_a_peaked_adapter_agrees_at_every_position(client, int4_dir, tmp_path):
    """A mean over hundreds of tokens of a near-flat model hides a bug at a few positions (the
    first sampled token, a shared prompt). Here the adapter is trained until the model is
    sharp on a few continuations (the sampled tokens are likely ones, where a wrong position
    shows); every position is bounded, the first token of each completion and the second
    completion of each prompt (sampled in the same request, on the prompt's shared KV) included.
    (The prompts are shorter than a KV block: a cross-request prefix-cache hit is not tested here.)"""
    torch.manual_seed(0)
    trainer = load_policy(int4_dir, ADAPTER, dtype="fp32")  # trained in fp32, served and scored in fp16
    prompts = _prompts(4, seed=3)
    targets = [[random.Random(i).randrange(0, 96) for _ in range(8)] for i in range(4)]
    # 3e-3: converges (loss ~0.57) on every CPU tried; 1e-2 diverged past step 20 on an AVX2 one (other fp32 rounding)
    optimizer = torch.optim.AdamW(trainer.trainable_parameters(), lr=3e-3)
    for _ in range(40):
        loss = -torch.cat(trainer.completion_logprobs(list(zip(prompts, targets, strict=True)))).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    peaked = load_policy(int4_dir, ADAPTER, dtype="fp16")
    peaked.load_adapter_state(trainer.adapter_state())
    name = adapter_name(5)
    client.load_adapter(name, peaked.save_adapter(tmp_path / "v5"))
    groups = client.generate(prompts, model=name, n=2, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    completions = [c for group in groups for c in group]
    with torch.no_grad():
        learner = peaked.completion_logprobs([(c.prompt_ids, c.token_ids) for c in completions])
    rollout = [torch.tensor(c.logprobs) for c in completions]
    deltas = [(a.float() - b).abs() for a, b in zip(learner, rollout, strict=True)]
    delta, sampled = torch.cat(deltas), torch.cat(rollout)
    # peaked: a third of the sampled tokens have p > 0.37 (a flat model gives them all ~1/100)
    assert (sampled > -1.0).float().mean() > 1 / 3, f"not peaked: sampled log-probs {sampled}"
    assert delta.quantile(0.99) < 1e-2 and delta.max() < 2e-2, f"p99 {delta.quantile(0.99):.4f} max {delta.max():.4f}"
    assert max(float(d[0]) for d in deltas) < 1e-2  # the first token (prefill's last position)
    assert max(float(d.max()) for d in deltas[1::2]) < 2e-2  # each prompt's second completion
