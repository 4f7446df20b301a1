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
    assert mismatch_weights(old, rollout, "mis", cap=2.0).tolist() == [1.0, 0.0, 0.25]  # rho * 1{rho <= cap}
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


# --- numerics and semantics matched to verl (verl/trainer/ppo/core_algos.py, rollout_corr_helper.py) ---

AGGREGATIONS = ("token_mean", "sequence_mean", "token_sum_norm")
CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence")


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("value", [0.7, 0.1, 1 / 3, -2.3, 1e6 + 0.1])
def test_equal_rewards_give_exactly_zero_advantage(value, normalize_std):
    # float32 0.7 * 8 does not average back to 0.7 exactly; the residue / (std + 1e-6) used to reach +-0.06
    rewards = torch.tensor([value] * 8 + [0.0, 1.0] * 4)
    adv = group_advantages(rewards, group_size=8, normalize_std=normalize_std)
    assert adv[:8].tolist() == [0.0] * 8
    assert adv[8:].abs().min() > 0.4  # a group with signal is untouched


def _batch(seed: int, nan_fill: float | None = None, b: int = 6, t: int = 7):
    """Random right-padded batch; row 2 is empty (fully masked). NAN_FILL goes into every masked position."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[2] = 0
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()
    logp = -3 * torch.rand(b, t, generator=g)
    old = logp + 0.3 * torch.randn(b, t, generator=g)
    rollout = old + 0.4 * torch.randn(b, t, generator=g)
    ref = logp + 0.8 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    if nan_fill is not None:
        pad = mask == 0
        logp, old, rollout, ref = (x.masked_fill(pad, nan_fill) for x in (logp, old, rollout, ref))
    return logp, old, rollout, ref, adv, mask


def _config(aggregation, correction, level="token", **overrides):
    kwargs = dict(clip_low=0.2, clip_high=0.28, kl_beta=0.1, aggregation=aggregation, correction=correction,
                  is_cap=1.5, max_tokens=7, mismatch_level=level, dual_clip=1.4, kl_clamp=0.5)  # fmt: skip
    kwargs.update(overrides)
    return LossConfig(**kwargs)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_nan_and_inf_in_masked_positions_do_not_leak(aggregation, correction, level):
    results = []
    for fill in (float("nan"), float("inf"), float("-inf"), 0.0):
        logp, old, rollout, ref, adv, mask = _batch(seed=1, nan_fill=fill)
        logp.requires_grad_(True)
        # token level: a config the pre-fix LossConfig also accepted; sequence level adds dual clip and KL clamp
        config = (LossConfig(kl_beta=0.1, aggregation=aggregation, correction=correction, max_tokens=7)
                  if level == "token" else _config(aggregation, correction, level))  # fmt: skip
        out = grpo_loss(LossInputs(logp, old, rollout, adv, mask, ref), config)
        out.loss.backward()
        assert torch.isfinite(out.loss), fill
        assert torch.isfinite(logp.grad).all(), fill
        stats = (
            out.policy_loss,
            out.kl,
            out.clip_fraction,
            out.is_weight_mean,
            out.dual_clip_fraction,
            out.mis_rejected_fraction,
        )
        assert all(math.isfinite(s) for s in stats), (fill, stats)
        results.append((out.loss.item(), stats, logp.grad.clone()))
    zero_loss, zero_stats, zero_grad = results[-1]
    for loss, stats, grad in results[:-1]:
        assert loss == zero_loss and stats == zero_stats
        assert torch.equal(grad, zero_grad)
    assert torch.all(zero_grad[mask == 0] == 0)


def test_token_sum_norm_requires_max_tokens():
    with pytest.raises(ValueError, match="max_tokens"):
        LossConfig(aggregation="token_sum_norm")
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "token_sum_norm", None)
    LossConfig(aggregation="token_mean")  # the other modes do not need it
    assert LossConfig(aggregation="token_sum_norm", max_tokens=16).max_tokens == 16


def test_empty_sequences_do_not_count_in_sequence_denominators():
    # verl agg_loss: seq-mean-* divide by the number of sequences with at least one real token
    per_token = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert aggregate(per_token, mask, "token_mean", 3).item() == pytest.approx(7 / 3)
    assert aggregate(per_token, mask, "sequence_mean", 3).item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(per_token, mask, "token_sum_norm", 3).item() == pytest.approx(7 / (2 * 3))
    for mode in AGGREGATIONS:  # an all-empty batch is 0, not NaN
        assert aggregate(per_token, torch.zeros(3, 3), mode, 3).item() == 0.0


def test_mis_keeps_the_importance_weight_of_kept_tokens():
    old = torch.zeros(4)
    rollout = -torch.log(torch.tensor([1.0, 4.0, 0.25, 1.5]))  # rho = old / rollout = 1, 4, 0.25, 1.5
    assert mismatch_weights(old, rollout, "mis", cap=2.0).tolist() == pytest.approx([1.0, 0.0, 0.25, 1.5])
    assert mismatch_weights(old, rollout, "tis", cap=2.0).tolist() == pytest.approx([1.0, 2.0, 0.25, 1.5])


def test_sequence_level_mismatch_weights():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # per-token rho: row 0: 1.5, 1.2 (-> 1.8); row 1: 1.5, 1.5, 1.5 (-> 3.375); row 2: 0.5 (-> 0.5); padding is junk
    rho = torch.tensor([[1.5, 1.2, 100.0], [1.5, 1.5, 1.5], [0.5, float("nan"), 1e-9]])
    old = torch.log(rho)
    rollout = torch.zeros(3, 3)
    seq = {"level": "sequence", "mask": mask}
    expected_tis = [[1.8, 1.8], [2.0, 2.0, 2.0], [0.5]]
    expected_mis = [[1.8, 1.8], [0.0, 0.0, 0.0], [0.5]]
    for mode, expected in (("tis", expected_tis), ("mis", expected_mis)):
        w = mismatch_weights(old, rollout, mode, cap=2.0, **seq)
        assert [w[i, : len(e)].tolist() for i, e in enumerate(expected)] == [pytest.approx(e) for e in expected]
    token_mis = mismatch_weights(old, rollout, "mis", cap=2.0, level="token", mask=mask)
    assert token_mis[1].tolist() == pytest.approx([1.5, 1.5, 1.5])  # each token alone is under the cap


def test_mis_rejected_tokens_still_count_in_the_denominator():
    logp = torch.zeros(1, 2, requires_grad=True)
    rollout = -torch.log(torch.tensor([[1.5, 4.0]]))  # rho 1.5 (kept, weight 1.5) and 4 (rejected)
    inputs = LossInputs(logp, torch.zeros(1, 2), rollout, torch.tensor([2.0]), torch.ones(1, 2))
    out = grpo_loss(inputs, LossConfig(correction="mis", is_cap=2.0))
    assert out.loss.item() == pytest.approx(-(2.0 * 1.5 + 0.0) / 2)  # / 2 real tokens, not / 1 kept
    assert out.is_weight_mean == pytest.approx(1.5 / 2)
    assert out.mis_rejected_fraction == pytest.approx(0.5)


def test_kl_at_beta_zero_is_reported_and_leaves_the_loss_alone():
    """reference.report_kl: reference log-probs at kl_beta 0 give the step's KL, and the same loss and gradient."""
    ref = torch.tensor([[-1.0, -2.5]])
    losses, grads = [], []
    for with_ref in (False, True):
        logp = torch.tensor([[-1.2, -2.0]], requires_grad=True)
        inputs = LossInputs(logp, logp.detach(), logp.detach(), torch.tensor([1.0]), torch.ones(1, 2),
                            ref_logprobs=ref if with_ref else None)  # fmt: skip
        out = grpo_loss(inputs, LossConfig(kl_beta=0.0))
        out.loss.backward()
        losses.append(out.loss.item())
        grads.append(logp.grad.clone())
        expected_kl = float(k3_kl_penalty(logp.detach(), ref).mean()) if with_ref else 0.0
        assert out.kl == pytest.approx(expected_kl) and (out.kl > 0) == with_ref
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1])


def test_over_cap_fraction_counts_ratios_above_the_cap_under_every_correction():
    """is_over_cap_fraction: what TIS truncates (and MIS rejects), measured with no correction too,
    over the real tokens only; at the sequence level a sequence's product ratio is its tokens'."""
    logp = torch.zeros(2, 3)
    rollout = -torch.log(torch.tensor([[1.5, 4.0, 3.0], [1.5, 1.5, 9.0]]))  # token ratios; [1, 2] is padding
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    inputs = LossInputs(logp, torch.zeros(2, 3), rollout, torch.tensor([1.0, -1.0]), mask)
    for correction in ("none", "tis", "mis"):
        out = grpo_loss(inputs, LossConfig(correction=correction, is_cap=2.0))
        assert out.is_over_cap_fraction == pytest.approx(2 / 5), correction  # 4.0 and 3.0; the padded 9.0 does not count
    seq = grpo_loss(inputs, LossConfig(correction="none", is_cap=2.0, mismatch_level="sequence"))
    assert seq.is_over_cap_fraction == pytest.approx(1.0)  # products 18 and 2.25: both sequences, all 5 tokens


def test_clip_fraction_counts_only_tokens_where_the_clipped_term_wins():
    # clip range [0.8, 1.28]; the min picks the clipped term only where it is strictly smaller
    logr = torch.log(torch.tensor([[1.6, 0.5, 1.6, 0.5, 1.6, 5.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0, 1.0]]).T  # one token per sequence
    # A>0, r high: clipped 1.28 < 1.6 -> counted | A>0, r low: 0.5 < 0.8, unclipped chosen -> not counted
    # A<0, r high: -1.6 < -1.28, unclipped chosen -> not | A<0, r low: -0.8 < -0.5 -> counted
    # A=0: terms equal -> not counted | last row is padding -> not counted
    inputs = LossInputs(
        logprobs=logr.T.clone(), old_logprobs=torch.zeros(6, 1), rollout_logprobs=torch.zeros(6, 1),
        advantages=adv.squeeze(1), mask=torch.tensor([[1.0], [1.0], [1.0], [1.0], [1.0], [0.0]]),
    )  # fmt: skip
    out = grpo_loss(inputs, LossConfig(clip_low=0.2, clip_high=0.28, correction="none"))
    assert out.clip_fraction == pytest.approx(2 / 5)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    logp = torch.tensor([[1.5], [1.5], [0.5]], requires_grad=True)  # ratios e^1.5 = 4.48, 4.48, 1.65
    inputs = LossInputs(logp, torch.zeros(3, 1), torch.zeros(3, 1), torch.tensor([-1.0, 1.0, -1.0]), torch.ones(3, 1))
    out = grpo_loss(inputs, LossConfig(correction="none", dual_clip=3.0))
    # row 0: -A * min(r, c) = 3 (capped, was 4.48); row 1: clipped at 1.28; row 2: r < c -> unclipped -A * r
    assert out.loss.item() == pytest.approx((3.0 - 1.28 + math.exp(0.5)) / 3)
    assert out.dual_clip_fraction == pytest.approx(1 / 3)
    out.loss.backward()
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, 0.0, math.exp(0.5) / 3])  # capped: no gradient
    off = grpo_loss(inputs, LossConfig(correction="none", dual_clip=None))
    assert off.loss.item() == pytest.approx((math.exp(1.5) - 1.28 + math.exp(0.5)) / 3)
    assert LossConfig().dual_clip == 3.0  # on by default, as verl's clip_ratio_c
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=1.0)


def test_k3_kl_clamp():
    logp = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.5, 5.0, 200.0])  # k3 = 0.149, 142.4, huge
    kl = k3_kl_penalty(logp, ref, clamp=10.0)
    assert kl.tolist() == pytest.approx([math.exp(0.5) - 1.5, 10.0, 10.0])
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[1:].tolist() == [0.0, 0.0]
    assert torch.isfinite(k3_kl_penalty(logp.detach(), ref)).all()  # unclamped: still finite (log-ratio bounded)
    assert LossConfig().kl_clamp == 10.0
    inputs = LossInputs(logp.detach()[None].requires_grad_(), torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1),
                        torch.ones(1, 3), ref[None])  # fmt: skip
    out = grpo_loss(inputs, LossConfig(kl_beta=1.0, correction="none", kl_clamp=10.0))
    assert out.kl == pytest.approx((math.exp(0.5) - 1.5 + 20) / 3)
    with pytest.raises(ValueError, match="kl_clamp"):
        LossConfig(kl_clamp=0.0)


def _reference_loss(logp, old, rollout, ref, adv, mask, config):
    """Straightforward per-element GRPO loss in Python floats (independent of grpo.py's tensor code)."""
    logp, old, rollout, ref, mask = (x.tolist() for x in (logp, old, rollout, ref, mask))
    adv = adv.tolist()
    policy_rows, kl_rows, weights, clipped, capped, rejected = [], [], [], 0, 0, 0
    for i in range(len(mask)):
        real = [t for t in range(len(mask[i])) if mask[i][t] > 0]
        seq_log_ratio = sum(old[i][t] - rollout[i][t] for t in real)
        policy_row, kl_row = [], []
        for t in real:
            a = adv[i]
            r = math.exp(logp[i][t] - old[i][t])
            r_clip = min(max(r, 1 - config.clip_low), 1 + config.clip_high)
            objective = min(r * a, r_clip * a)
            clipped += r_clip * a < r * a
            if config.dual_clip is not None and a < 0 and objective < config.dual_clip * a:
                objective, capped = config.dual_clip * a, capped + 1
            log_rho = seq_log_ratio if config.mismatch_level == "sequence" else old[i][t] - rollout[i][t]
            rho = math.exp(log_rho)
            w = {"none": 1.0, "tis": min(rho, config.is_cap), "mis": rho if rho <= config.is_cap else 0.0}[config.correction]
            rejected += config.correction == "mis" and rho > config.is_cap
            weights.append(w)
            policy_row.append(-objective * w)
            d = max(min(ref[i][t] - logp[i][t], 20.0), -20.0)
            k3 = math.exp(d) - d - 1
            if config.kl_clamp is not None:
                k3 = max(min(k3, config.kl_clamp), -config.kl_clamp)
            kl_row.append(k3)
        policy_rows.append(policy_row)
        kl_rows.append(kl_row)

    def reduce(rows, mode):
        nonempty = [r for r in rows if r]
        if mode == "token_mean":
            return sum(sum(r) for r in rows) / max(1, sum(len(r) for r in rows))
        if mode == "sequence_mean":
            return sum(sum(r) / len(r) for r in nonempty) / max(1, len(nonempty))
        return sum(sum(r) for r in rows) / (max(1, len(nonempty)) * config.max_tokens)

    policy, kl = reduce(policy_rows, config.aggregation), reduce(kl_rows, config.aggregation)
    tokens = max(1, len(weights))
    fractions = clipped / tokens, sum(weights) / tokens, capped / tokens, rejected / tokens
    return (policy + config.kl_beta * kl, policy, kl, *fractions)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_grpo_loss_matches_a_per_element_reference(aggregation, correction, level):
    for seed in range(5):
        logp, old, rollout, ref, adv, mask = _batch(seed, nan_fill=float("nan"))
        config = _config(aggregation, correction, level)
        out = grpo_loss(LossInputs(logp, old, rollout, adv, mask, ref), config)
        loss, policy, kl, clip_fraction, weight_mean, dual, rejected = _reference_loss(logp, old, rollout, ref, adv, mask, config)
        assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert out.policy_loss == pytest.approx(policy, rel=1e-5, abs=1e-6)
        assert out.kl == pytest.approx(kl, rel=1e-5, abs=1e-6)
        assert out.clip_fraction == pytest.approx(clip_fraction)
        assert out.is_weight_mean == pytest.approx(weight_mean, rel=1e-5)
        assert (out.dual_clip_fraction, out.mis_rejected_fraction) == pytest.approx((dual, rejected))


def test_algorithm_spec_fields_validate_and_match_the_loss_defaults():
    from orbit_runtime.config import parse_job_spec
    from orbit_runtime.config.spec import AlgorithmSpec
    from orbit_runtime.errors import OrbitError

    spec = AlgorithmSpec()
    defaults = LossConfig()
    assert (spec.mismatch_level, spec.dual_clip, spec.kl_clamp) == (
        defaults.mismatch_level,
        defaults.dual_clip,
        defaults.kl_clamp,
    )
    assert (spec.is_cap, spec.mismatch_correction) == (defaults.is_cap, defaults.correction)
    ok = parse_job_spec(
        {"model": {"path": "/m"}, "algorithm": {"mismatch_level": "sequence", "dual_clip": None, "kl_clamp": None}}
    )
    assert (ok.algorithm.mismatch_level, ok.algorithm.dual_clip, ok.algorithm.kl_clamp) == ("sequence", None, None)
    for field, bad in (("dual_clip", 1.0), ("kl_clamp", 0), ("mismatch_level", "geometric"), ("is_cap", 1.0)):
        with pytest.raises(OrbitError, match=f"algorithm.{field}"):
            parse_job_spec({"model": {"path": "/m"}, "algorithm": {field: bad}})
