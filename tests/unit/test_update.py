"""The policy update on a tiny INT4 policy: log-probs at the sampling temperature, scoring vs
training modes (dropout), and the snapshot that rolls a failed commit back."""

import pytest
import torch

from orbit_runtime.algorithms.grpo import LossConfig
from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.model import load_policy
from orbit_runtime.learner.update import UpdateBatch, policy_update
from orbit_runtime.trainer.rollback import StepSnapshot

PAIRS = [([97, 86, 84, 70], [18, 19, 12, 40]), ([97, 66], [20, 21, 22, 23, 24]), ([97, 66], [20, 30])]
CONFIG = LossConfig(max_tokens=5)


def _policy(int4_dir, dropout=0.0):
    policy = load_policy(int4_dir, AdapterSpec(rank=8, alpha=16, dropout=dropout), dtype="fp32")
    policy.init_adapter_randomly(std=0.2, seed=0)
    return policy


def _batch(policy, temperature, advantages=(1.0, -1.0, 0.5)):
    with policy.scoring():
        rollout = policy.completion_logprobs(PAIRS, temperature=temperature)  # a rollout engine with no mismatch
    return UpdateBatch(PAIRS, [r.clone() for r in rollout], torch.tensor(advantages))


def test_logprobs_at_a_temperature_are_the_tempered_softmax(int4_dir):
    policy = _policy(int4_dir)
    ids = torch.tensor([PAIRS[0][0] + PAIRS[0][1]])
    with policy.scoring():
        logits = policy.model(input_ids=ids).logits[0, :-1].float()
        got = policy.token_logprobs(ids, temperature=0.7)[0]
        at_one = policy.token_logprobs(ids)[0]
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - at_one).abs().max() > 1e-2


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_update_at_the_sampling_temperature_sees_no_mismatch_and_moves_the_adapter(int4_dir, temperature):
    policy = _policy(int4_dir)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    before = policy.adapter_state()
    called = []
    result = policy_update(policy, optimizer, _batch(policy, temperature), CONFIG, temperature=temperature,
                           max_grad_norm=1.0, before_first_optimizer_step=lambda: called.append(policy.adapter_state()))  # fmt: skip
    assert result.mismatch.max_abs_dlogp < 1e-5 and result.mismatch.tokens == 11
    assert result.grad_norm > 0 and result.optimizer_steps == 1
    assert len(called) == 1 and all(torch.equal(called[0][k], before[k]) for k in before)  # hook ran before the change
    assert any(not torch.equal(v, before[k]) for k, v in policy.adapter_state().items())
    assert not policy.model.training  # back in scoring mode


def test_dropout_is_on_in_the_update_and_off_for_old_logprobs(int4_dir):
    policy = _policy(int4_dir, dropout=0.5)
    assert policy.has_dropout
    batch = _batch(policy, 1.0)
    with policy.training(), torch.no_grad():
        noisy = policy.completion_logprobs(PAIRS)
    assert (noisy[0] - batch.rollout_logprobs[0]).abs().max() > 1e-3  # training mode really drops out
    start = policy.adapter_state()
    adapters = []
    for seed in (1, 2):  # the update passes drop out: different masks, different updates
        policy.load_adapter_state(start)
        torch.manual_seed(seed)
        optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=1.0)
        result = policy_update(policy, optimizer, batch, CONFIG, temperature=1.0, max_grad_norm=1e9)
        # old log-probs (and the mismatch) come from scoring mode, exactly the rollout's here
        assert result.mismatch.max_abs_dlogp < 1e-6
        adapters.append(policy.adapter_state())
    assert any(not torch.allclose(adapters[0][k], adapters[1][k]) for k in start)


def test_snapshot_restores_the_learner_exactly(int4_dir):
    policy = _policy(int4_dir)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    policy_update(policy, optimizer, _batch(policy, 1.0), CONFIG, temperature=1.0, max_grad_norm=1.0)
    scheduler.step()
    adapter, lr = policy.adapter_state(), scheduler.get_last_lr()
    moments = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    snapshot = StepSnapshot.capture(policy, optimizer, scheduler, sampler_state={"cursor": 7})
    random_draw = torch.rand(3)

    policy_update(policy, optimizer, _batch(policy, 1.0, (-1.0, 1.0, 0.0)), CONFIG, temperature=1.0, max_grad_norm=1.0)
    scheduler.step()
    assert snapshot.restore(policy, optimizer, scheduler) == {"cursor": 7}
    assert torch.equal(torch.rand(3), random_draw)  # the RNG is back where the step started
    assert all(torch.equal(policy.adapter_state()[k], v) for k, v in adapter.items())
    assert scheduler.get_last_lr() == lr
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(value, moments[key]), key
