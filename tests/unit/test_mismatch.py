import math

import pytest
import torch

from orbit_runtime.algorithms.mismatch import k3_kl, measure_mismatch


def test_hand_computed_values():
    learner = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    rollout = [torch.tensor([-1.5, -2.0]), torch.tensor([-0.25])]
    stats = measure_mismatch(learner, rollout)
    assert stats.tokens == 3
    assert stats.mean_abs_dlogp == pytest.approx((0.5 + 0 + 0.25) / 3)
    assert stats.max_abs_dlogp == pytest.approx(0.5)
    expected_k3 = ((math.exp(0.5) - 1 - 0.5) + 0 + (math.exp(-0.25) - 1 + 0.25)) / 3
    assert stats.k3_kl == pytest.approx(expected_k3)


def test_k3_is_zero_for_equal_and_positive_otherwise():
    x = torch.randn(100)
    assert torch.all(k3_kl(x, x) == 0)
    assert torch.all(k3_kl(x, x + torch.randn(100)) >= 0)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="sequence 0"):
        measure_mismatch([torch.zeros(3)], [torch.zeros(2)])
