"""GRPO pieces against values computed by hand."""

import math

import pytest
import torch

from orbit_runtime.algorithms.grpo import (
    LossConfig,
    LossInputs,
    aggregate,
    group_advantages,
    grpo_loss,
    k3_kl_penalty,
    mismatch_weights,
)


def test_group_advantages_centre_and_scale_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # equal rewards: no signal, no NaN
    assert group_advantages(rewards, 4, normalize_std=False)[:4].tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def test_k3_kl():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.0, -1.5])
    expected = [0.0, math.exp(0.5) - 0.5 - 1]
    assert k3_kl_penalty(logp, ref).tolist() == pytest.approx(expected)


def test_tis_and_mis_weights():
    old = torch.tensor([0.0, 0.0, 0.0])
    rollout = torch.log(torch.tensor([1.0, 0.25, 4.0]))  # ratios 1, 4, 0.25
    assert mismatch_weights(old, rollout, "tis", cap=2.0).tolist() == pytest.approx([1.0, 2.0, 0.25])
    assert mismatch_weights(old, rollout, "mis", cap=2.0).tolist() == [1.0, 0.0, 0.0]
    assert mismatch_weights(old, rollout, "none", cap=2.0).tolist() == [1.0, 1.0, 1.0]


def test_aggregations():
    per_token = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(per_token, mask, "token_mean", 3).item() == pytest.approx(7 / 3)  # DAPO
    assert aggregate(per_token, mask, "sequence_mean", 3).item() == pytest.approx((1.5 + 4) / 2)  # GRPO
    assert aggregate(per_token, mask, "token_sum_norm", 3).item() == pytest.approx(7 / 6)  # Dr.GRPO


def test_ppo_clip_low_and_high():
    # token 0: ratio e^0.5 = 1.65 with A=+1 -> clipped at 1.28; token 1: ratio e^-0.5 = 0.61 with A=-1 -> clipped at 0.8
    logp = torch.tensor([[0.5], [-0.5]], requires_grad=True)
    inputs = LossInputs(
        logprobs=logp, old_logprobs=torch.zeros(2, 1), rollout_logprobs=torch.zeros(2, 1),
        advantages=torch.tensor([1.0, -1.0]), mask=torch.ones(2, 1),
    )  # fmt: skip
    out = grpo_loss(inputs, LossConfig(clip_low=0.2, clip_high=0.28, correction="none"))
    assert out.loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    assert out.clip_fraction == 1.0
    out.loss.backward()
    assert logp.grad.abs().sum() == 0  # clipped tokens carry no gradient


def test_unclipped_gradient_is_advantage_weighted_and_tis_scaled():
    logp = torch.zeros(1, 2, requires_grad=True)
    rollout = torch.log(torch.tensor([[0.5, 4.0]]))  # ratios old/rollout = 2 and 0.25
    inputs = LossInputs(
        logprobs=logp, old_logprobs=torch.zeros(1, 2), rollout_logprobs=rollout,
        advantages=torch.tensor([2.0]), mask=torch.ones(1, 2),
    )  # fmt: skip
    out = grpo_loss(inputs, LossConfig(correction="tis", is_cap=1.5))
    out.loss.backward()
    # d/dlogp of -(ratio * A * w) at ratio 1 = -A * w, token-mean over 2 tokens
    assert logp.grad[0].tolist() == pytest.approx([-2.0 * 1.5 / 2, -2.0 * 0.25 / 2])
    assert out.is_weight_mean == pytest.approx((1.5 + 0.25) / 2)


def test_kl_penalty_adds_beta_times_k3():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    inputs = LossInputs(
        logprobs=logp, old_logprobs=logp.detach(), rollout_logprobs=logp.detach(),
        advantages=torch.tensor([0.0]), mask=torch.ones(1, 2), ref_logprobs=ref,
    )  # fmt: skip
    out = grpo_loss(inputs, LossConfig(kl_beta=0.1, correction="none"))
    k3 = (math.exp(0.5) - 0.5 - 1) / 2
    assert out.kl == pytest.approx(k3)
    assert out.loss.item() == pytest.approx(0.1 * k3)
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(LossInputs(logp, logp.detach(), logp.detach(), torch.tensor([0.0]), torch.ones(1, 2)), LossConfig(kl_beta=0.1))


def test_lr_schedules_warm_up_then_decay_to_the_floor():
    from orbit_runtime.algorithms.lr_schedule import lr_multiplier

    warm = [lr_multiplier(s, warmup=3, total=13) for s in range(5)]
    assert warm == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = [lr_multiplier(s, warmup=3, total=13, kind="cosine", min_ratio=0.1) for s in (3, 8, 13, 20)]
    assert cosine == pytest.approx([1.0, 0.55, 0.1, 0.1])  # halfway: 0.1 + 0.9 * 0.5
    linear = [lr_multiplier(s, warmup=0, total=10, kind="linear") for s in (0, 5, 10)]
    assert linear == pytest.approx([1.0, 0.5, 0.0])


def test_decay_horizon_is_part_of_the_config_hash():
    from orbit_runtime.config import parse_job_spec
    from orbit_runtime.config.fingerprint import config_hash, training_fields

    def hash_of(**schedule):
        return config_hash(training_fields(parse_job_spec({"model": {"path": "/m"}, "schedule": schedule})))

    assert hash_of(steps=10) == hash_of(steps=20)  # constant LR: a run may be extended
    assert hash_of(steps=10, lr_schedule="cosine") != hash_of(steps=20, lr_schedule="cosine")
