"""The policy that samples is the policy that is trained: vLLM returns the log-probs of the
distribution it sampled from (after temperature) and the learner computes the same ones;
a prompt drawn twice in one batch gets two different groups. Real vLLM server (CPU build)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from orbit_runtime.algorithms.mismatch import measure_mismatch
from orbit_runtime.config import AdapterSpec, parse_job_spec
from orbit_runtime.data.datasets import Example
from orbit_runtime.learner.model import load_policy
from orbit_runtime.rewards.scoring import RewardScorer
from orbit_runtime.sync.adapter_sync import publish_adapter
from orbit_runtime.trainer.batch import BatchBuilder

from .conftest import RANK

pytestmark = pytest.mark.vllm
PROMPTS = [[97, 86, 84, 70, 83, 0, 33], [97, 66, 67, 68, 40]]


@pytest.fixture(scope="module")
def peaked(int4_dir, tmp_path_factory, rollout_client):
    """A policy whose adapter makes the next-token distributions peaked (a random model's are
    nearly flat, where temperature hardly matters), served by vLLM under the same weights."""
    policy = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype="fp16")
    policy.init_adapter_randomly(std=0.5, seed=3)
    path, _ = publish_adapter(policy, tmp_path_factory.mktemp("adapters"), 500)
    rollout_client.load_adapter("peaked-v500", path)
    return policy, "peaked-v500"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_are_the_learners_at_the_sampling_temperature(rollout_client, peaked, temperature):
    policy, name = peaked
    groups = rollout_client.generate(PROMPTS, model=name, n=4, max_tokens=24, temperature=temperature, seed=[5, 6])
    completions = [c for g in groups for c in g]
    pairs = [(c.prompt_ids, c.token_ids) for c in completions]
    rollout = [torch.tensor(c.logprobs) for c in completions]
    with policy.scoring():
        learner = policy.completion_logprobs(pairs, temperature=temperature)
        at_t1 = policy.completion_logprobs(pairs, temperature=1.0)
    mismatch = measure_mismatch(learner, rollout)
    assert mismatch.tokens >= 100
    assert mismatch.mean_abs_dlogp < 1e-2, mismatch  # as tight at T=0.7 as at T=1 (fp16 noise)
    assert mismatch.max_abs_dlogp < 5e-2, mismatch  # at every position
    if temperature != 1.0:  # and the temperature really changes the numbers: scoring at T=1 would be far off
        assert measure_mismatch(at_t1, rollout).mean_abs_dlogp > 10 * mismatch.mean_abs_dlogp


class DirectRollout:
    """The real server without restart supervision (not what this test is about)."""

    served_name = None

    def __init__(self, client) -> None:
        self.client = client

    def call(self, fn, kind: str = ""):
        return fn(self.client)


def test_duplicate_prompts_in_a_batch_get_distinct_groups_reproducibly(rollout_client, int4_dir):
    spec = parse_job_spec({"model": {"path": str(int4_dir)}, "rollout": {"group_size": 4, "max_tokens": 12}})
    builder = BatchBuilder(spec, AutoTokenizer.from_pretrained(int4_dir), RewardScorer(spec.rewards),
                           DirectRollout(rollout_client), reference=None)  # fmt: skip
    same = Example(prompt="What is 2+3?", answer="5")
    first = builder.generate([same, same], step=7)
    groups = [[c.token_ids for c in first[:4]], [c.token_ids for c in first[4:]]]
    assert groups[0] != groups[1]  # each position has its own seed
    again = builder.generate([same, same], step=7)
    assert [c.token_ids for c in again] == [c.token_ids for c in first]  # reproducible (resume redoes a step exactly)
    assert [c.token_ids for c in builder.generate([same, same], step=8)] != [c.token_ids for c in first]


@pytest.mark.parametrize("report_kl", [False, True])
def test_report_kl_scores_the_reference_at_kl_beta_zero(rollout_client, int4_dir, peaked, tmp_path, report_kl):
    """reference.report_kl: the batch carries the reference's log-probs (the base, adapter off) though
    kl_beta is 0 (grpo_loss then reports the KL without adding it: test_grpo); without it, no reference
    forward runs."""
    from orbit_runtime.trainer.roles import ReferenceRole

    policy, name = peaked
    spec = parse_job_spec({"model": {"path": str(int4_dir)}, "rollout": {"group_size": 2, "max_tokens": 8},
                           "reference": {"report_kl": report_kl}})  # fmt: skip
    assert spec.algorithm.kl_beta == 0
    reference = ReferenceRole("shared", policy, int4_dir, "fp16", tmp_path / "reference.log", 0)
    direct = DirectRollout(rollout_client)
    direct.served_name = name
    builder = BatchBuilder(spec, AutoTokenizer.from_pretrained(int4_dir), RewardScorer(spec.rewards), direct, reference)
    timings: dict[str, float] = {}
    batch = builder.build([0], [Example(prompt="What is 2+3?", answer="5")], step=1, timings=timings)
    if not report_kl:
        assert batch.ref_logprobs is None
        return
    assert [len(r) for r in batch.ref_logprobs] == [len(c.token_ids) for c in batch.completions]
    # the reference is the base, not the served (peaked) adapter: its log-probs differ from the rollout's
    rollout = [torch.tensor(c.logprobs) for c in batch.completions]
    assert measure_mismatch(batch.ref_logprobs, rollout).mean_abs_dlogp > 0.05
