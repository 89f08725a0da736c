"""PPO's critic in the trainer's own step: it learns the returns, reads the same values from packed and
padded micro-batches, a NaN in it stops the step as one in the policy does, and it starts from the
checkpoint algorithm.critic.hf_checkpoint names."""

from __future__ import annotations

import orjson
import pytest

from tests.processes import run_module_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]


def test_the_critic_learns_the_returns_and_its_nan_stops_the_step(tmp_path, checkpoints):
    out = tmp_path / "result.json"
    policy, critic = checkpoints  # the same architecture, other weights
    run_module_ranks("tests.integration.ppo_worker", 1, out, policy, critic)
    result = orjson.loads(out.read_bytes())
    losses, explained = result["value_loss"], result["explained_variance"]
    # Its head starts at zero, so its first values explain nothing; ten steps on one rollout fit them.
    assert explained[0] == pytest.approx(0.0, abs=1e-6)
    assert losses[-1] < 0.5 * losses[0] and explained[-1] > 0.5, result
    assert 0 < result["max_value"] and result["packed_padded_values_gap"] <= 1e-5, result
    assert result["nan_step"] != "committed" and result["nan_step_left_weights"], result
    assert result["from_a_checkpoint"] == {
        "body_is_its_checkpoint": True,
        "body_is_not_the_policy": True,
        "head_is_zero": True,
    }, result
