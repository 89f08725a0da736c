"""The NaN guard's check of the reduced gradients: one sum answers, an overflowing sum of finite
values is still finite, and a single inf or NaN anywhere is caught."""

from __future__ import annotations

import pytest
import torch

from elastic_rl.trainer.grpo import all_finite

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_finite_values_whose_sum_overflows_are_finite():
    values = torch.full((8,), 3e38)
    assert not bool(values.sum().isfinite())
    assert all_finite(values)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_one_non_finite_value_is_caught(bad):
    values = torch.randn(10_000)
    values[1234] = bad
    assert not all_finite(values)
    values[0] = -values[1234]  # an inf cancelled by a -inf sums to NaN, not to a finite value
    assert not all_finite(values)
