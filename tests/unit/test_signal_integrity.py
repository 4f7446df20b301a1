"""The RL signal's guards, as pure logic: the discriminating canary, the on-policy guard,
failing rewards, truncated completions and the evaluation's error bars."""

import pytest
import torch

from orbit_runtime.config import parse_job_spec
from orbit_runtime.learner.update import UpdateBatch
from orbit_runtime.sync.adapter_sync import calibrated_tolerance, check_canary
from orbit_runtime.trainer.batch import truncated_rewards
from orbit_runtime.trainer.evaluation import describe_eval, mean_and_stderr
from orbit_runtime.trainer.on_policy import AUTO_MULTIPLE, CALIBRATION_STEPS, OnPolicyGuard

FLOOR = 0.004  # a bf16 noise floor
NEW = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0, -0.1])]


def _shift(rows, delta):
    return [r + delta for r in rows]


def test_a_stale_adapter_within_the_old_fixed_tolerance_is_caught():
    """One step moved the canary by 0.03: the old bf16 tolerance (0.1) passed v(N-1) served as N."""
    old = _shift(NEW, 0.03)
    stale = check_canary(NEW, old, _shift(old, FLOOR), tolerance=0.1, noise_floor=FLOOR)
    assert stale.to_expected < 0.1  # what the tolerance alone saw: a pass
    assert stale.conclusive and not stale.passed and stale.verdict == "failed"
    fresh = check_canary(NEW, old, _shift(NEW, FLOOR), tolerance=0.1, noise_floor=FLOOR)
    assert fresh.passed and fresh.verdict == "verified"
    assert fresh.to_previous == pytest.approx(0.026, abs=1e-6) and fresh.separation == pytest.approx(0.03, abs=1e-6)


def test_versions_closer_than_the_noise_are_inconclusive_not_silently_verified():
    old = _shift(NEW, 2 * FLOOR)  # below NOISE_MULTIPLE floors apart
    check = check_canary(NEW, old, _shift(old, 0.001), tolerance=calibrated_tolerance(FLOOR), noise_floor=FLOOR)
    assert not check.conclusive and check.passed and check.verdict == "inconclusive"
    assert check_canary(NEW, None, NEW, tolerance=0.01, noise_floor=FLOOR).verdict == "unchecked"
    too_far = check_canary(NEW, None, _shift(NEW, 0.05), tolerance=calibrated_tolerance(FLOOR), noise_floor=FLOOR)
    assert not too_far.passed


def test_the_calibrated_tolerance_follows_the_noise_floor():
    assert calibrated_tolerance(0.004) == pytest.approx(0.012)  # 3 floors
    assert calibrated_tolerance(0.0005) == pytest.approx(0.0055)  # at least the floor plus the margin
    assert parse_job_spec({"model": {"path": "/m"}}).sync.tolerance is None  # calibrated by default


def _row(step, mismatch, decode=None):
    return {"step": step, "mismatch_mean_abs": mismatch, "canary_decode_mean_abs_dlogp": decode}


def test_the_on_policy_guard_stops_after_consecutive_steps_over_the_bound():
    guard = OnPolicyGuard.from_spec(0.01, steps_allowed=2)
    assert guard.check(_row(1, 0.02), [])[1] is None  # one step over: not yet
    assert guard.check(_row(2, 0.005), [])[0]["off_policy_steps"] == 0  # the streak is broken
    assert guard.check(_row(3, 0.001, decode=0.05), [])[1] is None  # the decode canary counts too
    fields, error = guard.check(_row(4, 0.03), [])
    assert fields == {"mismatch_bound": 0.01, "off_policy_steps": 2}
    assert error is not None and error.reason == "OffPolicy" and "algorithm.max_mismatch (0.01)" in str(error)
    assert "for 2 consecutive steps" in str(error) and guard.health()["state"] == "exceeded"
    off = OnPolicyGuard.from_spec(None, steps_allowed=1)
    assert off.check(_row(1, 99.0), [])[1] is None and off.health()["state"] == "off"


def test_auto_calibrates_from_the_run_and_a_resume_continues_the_streak():
    guard = OnPolicyGuard.from_spec("auto", steps_allowed=1)
    rows = [_row(i + 1, 0.001 * (i + 1)) for i in range(CALIBRATION_STEPS)]
    for i, row in enumerate(rows):
        fields, error = guard.check(row, rows[: i + 1])
        assert error is None
    assert fields["mismatch_bound"] == pytest.approx(AUTO_MULTIPLE * 0.001 * CALIBRATION_STEPS)
    assert guard.check(_row(6, 1.0), rows)[1] is not None
    stopped = [{**_row(6, 1.0), "mismatch_bound": 0.02, "off_policy_steps": 2}]
    resumed = OnPolicyGuard.from_spec("auto", steps_allowed=3)
    resumed.restore(stopped)
    assert resumed.check(_row(7, 1.0), [])[1] is not None  # 2 + 1 = 3 consecutive under the calibrated bound
    loosened = OnPolicyGuard.from_spec(2.0, steps_allowed=3)  # the user raised the bound after the stop
    loosened.restore(stopped)
    assert loosened.check(_row(7, 1.0), [])[0] == {"mismatch_bound": 2.0, "off_policy_steps": 0}
    switched_off = OnPolicyGuard.from_spec(None, steps_allowed=1)
    switched_off.restore(stopped)
    assert switched_off.check(_row(7, 9.0), [])[1] is None


def test_truncated_completions_get_their_own_reward_or_leave_the_loss():
    assert truncated_rewards([1.0, 0.5, 0.0], [False, True, True], "reward", -1.0) == [1.0, -1.0, -1.0]
    assert truncated_rewards([1.0, 0.5], [False, True], "keep", -1.0) == [1.0, 0.5]
    batch = UpdateBatch([([1], [2, 3]), ([1], [4])], [torch.zeros(2), torch.zeros(1)], torch.zeros(2), loss_mask=[True, False])
    assert [batch.trained_length(i) for i in range(2)] == [2, 0]
    spec = parse_job_spec({"model": {"path": "/m"}, "rollout": {"truncated": "mask"}})
    assert spec.rollout.truncated == "mask"


def test_evaluation_reports_its_standard_error():
    mean, stderr = mean_and_stderr([1.0, 0.0, 1.0, 1.0])
    assert mean == 0.75 and stderr == pytest.approx((0.25 / 4) ** 0.5)  # sample std 0.5 / sqrt(4)
    assert mean_and_stderr([1.0]) == (1.0, 0.0)
    row = {"accuracy": 0.75, "accuracy_stderr": 0.25, "examples": 4, "samples_per_prompt": 1, "temperature": 0.0}
    assert describe_eval(row) == "75.0% ± 25.0% (4 prompts, greedy)"
    sampled = {**row, "samples_per_prompt": 4, "temperature": 1.0, "pass_at_k": 1.0}
    assert describe_eval(sampled) == "75.0% ± 25.0% (4 prompts, mean@4 at T=1, pass@4 100.0%)"


def test_a_masked_truncated_sample_leaves_the_loss_and_its_denominators(int4_dir):
    """rollout.truncated: mask (DAPO's overlong filtering): the update equals the update without the sample."""
    from orbit_runtime.algorithms.grpo import LossConfig
    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_policy
    from orbit_runtime.learner.update import policy_update

    torch.manual_seed(0)
    policy = load_policy(int4_dir, AdapterSpec(rank=4, alpha=8), dtype="fp32")
    policy.init_adapter_randomly(std=0.2, seed=0)
    pairs = [([97, 66, 67], [20, 21, 22]), ([97, 68], [24, 25, 26, 27, 28])]
    rollout = [torch.full((3,), -4.0), torch.full((5,), -4.0)]

    def grads(batch):
        optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)
        result = policy_update(policy, optimizer, batch, LossConfig(), temperature=1.0, max_grad_norm=1e9)
        return result, {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}

    masked, masked_grads = grads(UpdateBatch(pairs, rollout, torch.tensor([1.0, -1.0]), loss_mask=[True, False]))
    alone, alone_grads = grads(UpdateBatch(pairs[:1], rollout[:1], torch.tensor([1.0])))
    assert masked.loss == pytest.approx(alone.loss, rel=1e-5) and masked.grad_norm > 0
    for name, grad in alone_grads.items():
        torch.testing.assert_close(masked_grads[name], grad, rtol=1e-4, atol=1e-7)
