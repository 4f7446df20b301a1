"""Micro-batches and PPO minibatches: the plan, and updates that equal their one-batch
references (fp32, a tiny INT4 policy)."""

import dataclasses

import pytest
import torch

from orbit_runtime.algorithms.grpo import LossConfig, LossInputs, grpo_loss
from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.micro_batches import MicroBatchLimits, logprobs_in_micro_batches, split_minibatches
from orbit_runtime.learner.model import load_policy
from orbit_runtime.learner.update import UpdateBatch, pad, policy_update

# lengths differ a lot (so micro-batches pad differently) and one completion is empty
PAIRS = [
    ([97, 86, 84, 70], [18, 19, 12, 40]),
    ([97, 66], [20, 21, 22, 23, 24, 25, 26, 27, 28]),
    ([97, 66], [20, 30]),
    ([97, 61, 62], []),
    ([97, 80, 81, 82, 83, 84], [33]),
    ([97, 66], [44, 45, 46]),
]
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, 0.7, -0.3, 1.2])


def _policy(int4_dir):
    torch.manual_seed(0)  # PEFT draws lora_A from the global RNG: without a seed the test depends on what ran before
    policy = load_policy(int4_dir, AdapterSpec(rank=8, alpha=16), dtype="fp32")
    policy.init_adapter_randomly(std=0.2, seed=0)
    return policy


def _batch(policy, with_ref=False):
    """Rollout log-probs off the learner's by a fixed pattern, so TIS/MIS weights are not all 1."""
    with policy.scoring():
        learner = policy.completion_logprobs(PAIRS)
        with policy.adapter_disabled():
            ref = policy.completion_logprobs(PAIRS) if with_ref else None
    generator = torch.Generator().manual_seed(1)
    rollout = [r + 0.8 * torch.randn(r.shape, generator=generator) for r in learner]
    return UpdateBatch(PAIRS, rollout, ADVANTAGES.clone(), ref)


def _grads(policy):
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def test_plan_buckets_by_length_within_the_budget():
    lengths = [10, 100, 10, 100, 40, 300]
    plan = MicroBatchLimits(max_tokens=200).plan(lengths)
    assert sorted(i for group in plan for i in group) == list(range(len(lengths)))
    assert plan == [[5], [1, 3], [4, 0, 2]]  # longest first; 300 > budget stands alone
    for group in plan[1:]:
        assert len(group) * max(lengths[i] for i in group) <= 200
    assert MicroBatchLimits(max_samples=2).plan(lengths) == [[5, 1], [3, 4], [0, 2]]
    assert MicroBatchLimits().plan(lengths) == [[5, 1, 3, 4, 0, 2]]
    with pytest.raises(ValueError, match="max_tokens"):
        MicroBatchLimits(max_tokens=0)


def test_minibatches_are_contiguous_and_balanced():
    assert split_minibatches(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_minibatches(4, 1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="algorithm.minibatches"):
        split_minibatches(2, 3)


CONFIGS = {
    "token_mean": LossConfig(aggregation="token_mean", correction="tis"),
    "sequence_mean": LossConfig(aggregation="sequence_mean", correction="mis", is_cap=1.5),
    "token_sum_norm": LossConfig(aggregation="token_sum_norm", max_tokens=9, correction="tis"),
    "sequence_level_mis_kl": LossConfig(
        aggregation="sequence_mean", correction="mis", mismatch_level="sequence", is_cap=3.0, kl_beta=0.1
    ),  # fmt: skip
    "token_mean_kl": LossConfig(aggregation="token_mean", kl_beta=0.2, kl_clamp=None, dual_clip=None),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_micro_batched_loss_and_gradients_equal_one_batch(int4_dir, name):
    """One optimizer step per batch: the first pass's log-probs are the old ones (ratio 1)."""
    config = CONFIGS[name]
    policy = _policy(int4_dir)
    batch = _batch(policy, with_ref=config.kl_beta > 0)
    results, grads = [], []
    for limits in (MicroBatchLimits(), MicroBatchLimits(max_samples=1), MicroBatchLimits(max_tokens=24)):
        optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)  # gradients only: the adapter stays put
        results.append(policy_update(policy, optimizer, batch, config, temperature=1.0, max_grad_norm=1e9, limits=limits))
        grads.append(_grads(policy))
    assert [r.micro_batches for r in results] == [1, 6, 3]
    for result, grad in zip(results[1:], grads[1:], strict=True):
        for field in ("loss", "policy_loss", "kl", "clip_fraction", "is_weight_mean", "mis_rejected_fraction",
                      "is_over_cap_fraction", "dual_clip_fraction", "grad_norm"):  # fmt: skip
            assert getattr(result, field) == pytest.approx(getattr(results[0], field), rel=1e-5, abs=1e-7), field
        assert result.mismatch.mean_abs_dlogp == pytest.approx(results[0].mismatch.mean_abs_dlogp, rel=1e-5)
        for key in grad:  # fp32 rounding of differently shaped sums, relative to the tensor's scale
            torch.testing.assert_close(grad[key], grads[0][key], rtol=1e-4, atol=1e-4 * float(grads[0][key].abs().max()))
    assert results[0].grad_norm > 0 and abs(results[0].loss) > 0
    if config.correction == "mis":
        assert results[0].mis_rejected_fraction > 0  # the case where denominators matter most


@pytest.mark.parametrize("name", ["token_mean", "sequence_level_mis_kl", "token_sum_norm"])
def test_micro_batched_minibatch_steps_equal_one_batch_per_minibatch(int4_dir, name):
    """Two minibatches: the second step's ratios are off 1 (clipping and dual clip can act) and
    old log-probs come from a separate scoring pass; micro-batching still changes nothing."""
    config = dataclasses.replace(CONFIGS[name], clip_low=0.02, clip_high=0.02, dual_clip=1.05)  # tight: they act
    policy = _policy(int4_dir)
    start = policy.adapter_state()
    batch = _batch(policy, with_ref=config.kl_beta > 0)
    results, adapters = [], []
    for limits in (MicroBatchLimits(), MicroBatchLimits(max_samples=1), MicroBatchLimits(max_tokens=24)):
        policy.load_adapter_state(start)
        optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=20.0)
        results.append(policy_update(policy, optimizer, batch, config, temperature=1.0, max_grad_norm=1e9, minibatches=2,
                                     limits=limits))  # fmt: skip
        adapters.append(policy.adapter_state())
    assert results[0].clip_fraction > 0  # the second step clipped: the comparison covers the clipped branch
    for result, adapter in zip(results[1:], adapters[1:], strict=True):
        for field in ("loss", "policy_loss", "kl", "clip_fraction", "dual_clip_fraction", "mis_rejected_fraction"):
            assert getattr(result, field) == pytest.approx(getattr(results[0], field), rel=1e-4, abs=1e-6), field
        for key in adapter:  # the updates agree to fp32 rounding (relative norm; large steps amplify it a little)
            update, reference = adapter[key] - start[key], adapters[0][key] - start[key]
            assert float((update - reference).norm() / reference.norm()) < 1e-3, key


def test_scoring_in_micro_batches_equals_one_batch(int4_dir):
    policy = _policy(int4_dir)
    with policy.scoring():
        whole = policy.completion_logprobs(PAIRS, temperature=0.7)
        parts = logprobs_in_micro_batches(policy, PAIRS, MicroBatchLimits(max_tokens=20), temperature=0.7)
    for a, b in zip(whole, parts, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _reference_minibatch_update(policy, batch, config, chunks, epochs, lr):
    """PPO minibatches written out plainly: old log-probs once, then one full-batch step per chunk."""
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=lr)  # linear in the gradient: rounding stays small
    with policy.scoring():
        old = policy.completion_logprobs(batch.pairs)
    for _ in range(epochs):
        for chunk in chunks:
            optimizer.zero_grad()
            pairs = [batch.pairs[i] for i in chunk]
            with policy.training():
                new = pad(policy.completion_logprobs(pairs))
                inputs = LossInputs(new, pad([old[i] for i in chunk]), pad([batch.rollout_logprobs[i] for i in chunk]),
                                    batch.advantages[chunk], pad([torch.ones(len(c)) for _, c in pairs]))  # fmt: skip
                grpo_loss(inputs, config).loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), 1.0)
            optimizer.step()
    return policy.adapter_state()


@pytest.mark.parametrize(
    ("name", "minibatches", "epochs"),
    [("token_mean", 3, 1), ("token_mean", 3, 2), ("sequence_mean", 1, 2), ("token_sum_norm", 2, 2)],
)
def test_minibatched_update_equals_its_reference(int4_dir, name, minibatches, epochs):
    config = CONFIGS[name]
    policy = _policy(int4_dir)
    start = policy.adapter_state()
    batch = _batch(policy)
    chunks = split_minibatches(len(PAIRS), minibatches)
    expected = _reference_minibatch_update(policy, batch, config, chunks, epochs, lr=0.5)
    policy.load_adapter_state(start)
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.5)
    result = policy_update(policy, optimizer, batch, config, temperature=1.0, max_grad_norm=1.0, epochs=epochs,
                           minibatches=minibatches, limits=MicroBatchLimits(max_samples=1))  # fmt: skip
    assert result.optimizer_steps == minibatches * epochs and result.micro_batches == 6 * epochs
    got = policy.adapter_state()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)
    assert max(float((got[k] - start[k]).abs().max()) for k in start) > 1e-3  # the adapter moved, by more than the tolerance


@pytest.mark.parametrize(
    ("clip_low", "clip_high", "clips"),
    [(0.9, 0.01, True), (0.9, 10.0, False)],  # the upper bound (clip-higher) is what acts: ratios above 1 + clip_high
)
def test_clip_higher_engages_once_the_policy_moved_within_a_batch(int4_dir, clip_low, clip_high, clips):
    policy = _policy(int4_dir)
    start = policy.adapter_state()
    batch = _batch(policy)
    config = LossConfig(correction="none", clip_low=clip_low, clip_high=clip_high, dual_clip=None)
    fractions = {}
    for minibatches in (1, 3):
        policy.load_adapter_state(start)
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=0.2)
        result = policy_update(policy, optimizer, batch, config, temperature=1.0, max_grad_norm=10.0, minibatches=minibatches)
        fractions[minibatches] = result.clip_fraction
    assert fractions[1] == 0.0  # one optimizer step per batch: every ratio is 1, nothing to clip
    if clips:
        assert fractions[3] > 0.05  # later minibatches see the moved policy: ratios leave [1 - 0.9, 1 + 0.01]
    else:
        assert fractions[3] == 0.0  # same updates, but the ratios stay below 1 + 10: the upper bound decided above
