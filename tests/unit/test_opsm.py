"""Off-policy sequence masking (OPSM) against masks worked out by hand, with each advantage estimator,
with TIS, and under each loss aggregation."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from elastic_rl.algo.advantages import token_advantages
from elastic_rl.algo.losses import aggregate, off_policy_sequence_mask
from elastic_rl.algo.objective import token_losses
from elastic_rl.spec.algorithm import AdvantageEstimator, AlgorithmSpec, LossAggregation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

# Three sequences of up to three response tokens; the third token of the first is padding.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
OLD = torch.full((3, 3), -1.0)
# Mean drift (old - new) over each sequence's response tokens: 0.2, 0.05 and 0.5 (padding ignored).
LOGP = torch.tensor([[-1.1, -1.3, -9.0], [-1.05, -1.05, -1.05], [-1.5, -1.5, -1.5]])
DELTA = 0.1


def test_a_drifted_sequence_with_a_negative_advantage_is_masked_and_nothing_else():
    advantages = torch.tensor([[-1.0], [-1.0], [1.0]]).expand(3, 3)
    masked = off_policy_sequence_mask(LOGP, OLD, advantages, MASK, DELTA)
    # Sequence 0 drifted 0.2 > 0.1 with A < 0: its two response tokens; sequence 1 drifted only 0.05;
    # sequence 2 drifted 0.5 but its advantage is positive.
    assert torch.equal(masked, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_with_per_token_advantages_only_the_negative_tokens_of_a_drifted_sequence_are_masked():
    advantages = torch.tensor([[0.5, -0.5, -0.5], [-1.0, -1.0, -1.0], [-0.2, 0.3, -0.1]])
    masked = off_policy_sequence_mask(LOGP, OLD, advantages, MASK, DELTA)
    assert torch.equal(masked, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]))


ESTIMATORS = list(AdvantageEstimator)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_masked_tokens_give_no_policy_gradient_and_the_rest_are_unchanged(estimator, tis_cap):
    rewards = torch.tensor([0.0, 1.0, 1.0])
    advantages = token_advantages(estimator, rewards, MASK, group_size=3)
    expected = off_policy_sequence_mask(LOGP, OLD, advantages, MASK, DELTA)
    assert expected.any(), "the case must mask something"
    logp = LOGP.clone().requires_grad_()
    args = dict(
        entropy=torch.zeros(3, 3),
        old_logp=OLD,
        engine_logp=OLD - 0.3,
        ref_logp=None,
        advantages=advantages,
        mask=MASK,
    )
    plain = token_losses(AlgorithmSpec(advantage_estimator=estimator, tis_cap=tis_cap), logp, **args)
    spec = AlgorithmSpec(advantage_estimator=estimator, tis_cap=tis_cap, opsm=True, opsm_delta=DELTA)
    masked = token_losses(spec, logp, **args)
    assert torch.equal(masked.opsm_masked, expected) and plain.opsm_masked is None
    assert torch.equal(masked.pg, plain.pg * (1 - expected))
    (grad,) = torch.autograd.grad(aggregate(masked.loss, MASK, LossAggregation.TOKEN_MEAN, 8.0, 3), logp)
    assert torch.equal(grad[expected.bool()], torch.zeros(int(expected.sum())))
    assert grad[(MASK.bool() & ~expected.bool())].abs().sum() > 0


@pytest.mark.parametrize("how", list(LossAggregation))
def test_masked_tokens_still_count_in_each_aggregations_denominator(how):
    """As slime does it: the mask zeroes a token's loss and leaves the count it is divided by alone."""
    advantages = torch.tensor([[-1.0], [-1.0], [1.0]]).expand(3, 3)
    spec = AlgorithmSpec(opsm=True, opsm_delta=DELTA, loss_aggregation=how)
    args = dict(entropy=torch.zeros(3, 3), old_logp=OLD, engine_logp=OLD, ref_logp=None, advantages=advantages)
    masked = token_losses(spec, LOGP, mask=MASK, **args)
    plain = token_losses(AlgorithmSpec(loss_aggregation=how), LOGP, mask=MASK, **args)
    kept = MASK * (1 - masked.opsm_masked)
    assert aggregate(masked.loss, MASK, how, 8.0, 3) == pytest.approx(
        aggregate(plain.loss * kept, MASK, how, 8.0, 3).item()
    )


def test_opsm_is_refused_for_sft():
    with pytest.raises(ValidationError, match="opsm"):
        AlgorithmSpec(kind="sft", opsm=True)
