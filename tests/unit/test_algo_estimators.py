"""The advantage estimators, GSPO, TIS, the loss aggregations, KL in the reward and the entropy
bonus, each against a computation written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from elastic_rl.algo.advantages import returns_to_go, token_advantages, whiten
from elastic_rl.algo.losses import (
    aggregate,
    gspo_clipped_loss,
    loss_tokens,
    policy_token_loss,
    sequence_ratio,
    tis_weights,
)
from elastic_rl.algo.objective import token_losses
from elastic_rl.spec.algorithm import AdvantageEstimator, AlgorithmSpec, LossAggregation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_reinforce_plus_plus_whitens_the_returns_over_the_batch():
    advantages = token_advantages(AdvantageEstimator.REINFORCE_PLUS_PLUS, torch.tensor([1.0, 0.0]), MASK, group_size=2)
    # Returns 1, 1 (sequence 0) and 0 (sequence 1): mean 2/3, sample variance ((1/3)² + (1/3)² + (2/3)²) / 2 = 1/3.
    std = math.sqrt(1 / 3)
    expected = torch.tensor([[(1 / 3) / std, (1 / 3) / std, 0.0], [(-2 / 3) / std, 0.0, 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-5)


def test_reinforce_plus_plus_pays_the_kl_ahead_of_each_token():
    kl = torch.tensor([[0.5, 0.5, 9.0], [0.2, 9.0, 9.0]])
    returns = returns_to_go(torch.tensor([1.0, 0.0]), -0.1 * kl, MASK)
    # Token 0 of sequence 0: 1 - 0.05 - 0.05; token 1: 1 - 0.05; sequence 1: 0 - 0.02. Padding pays nothing.
    assert torch.allclose(returns, torch.tensor([[0.9, 0.95, 0.0], [-0.02, 0.0, 0.0]]))
    advantages = token_advantages(
        AdvantageEstimator.REINFORCE_PLUS_PLUS, torch.tensor([1.0, 0.0]), MASK, 2, token_kl=kl, kl_coef=0.1
    )
    assert torch.allclose(advantages, whiten(returns, MASK))


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_before_whitening():
    mask = torch.ones(4, 1)
    advantages = token_advantages(
        AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE, torch.tensor([1.0, 0.0, 0.5, 0.5]), mask, group_size=2
    )
    # Centred: 0.5, -0.5, 0, 0; mean 0, sample variance 0.5 / 3.
    std = math.sqrt(0.5 / 3)
    assert torch.allclose(advantages.squeeze(1), torch.tensor([0.5 / std, -0.5 / std, 0.0, 0.0]), atol=1e-5)


def test_kl_in_the_reward_lowers_the_group_advantage_of_the_sequence_that_drifted():
    mask = torch.ones(2, 2)
    kl = torch.tensor([[0.0, 0.0], [0.6, 0.4]])
    for estimator in (AdvantageEstimator.GRPO, AdvantageEstimator.GSPO):
        advantages = token_advantages(estimator, torch.tensor([1.0, 1.0]), mask, 2, token_kl=kl, kl_coef=0.5)
        # Rewards 1 and 1 - 0.5 * 1.0 = 0.5: mean 0.75, sample std sqrt(0.125).
        a = 0.25 / (math.sqrt(0.125) + 1e-6)
        assert torch.allclose(advantages, torch.tensor([[a, a], [-a, -a]]), atol=1e-5)


def test_gspo_ratio_is_the_sequence_mean_and_its_gradient_flows_per_token():
    logp = torch.tensor([[0.2, 0.0, 5.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    ratio = sequence_ratio(logp, old, mask)
    # exp(mean(0.2, 0.0)) = exp(0.1) at every token, padding included (the mask drops it later).
    assert torch.allclose(ratio, torch.full((1, 3), math.exp(0.1)))
    (ratio * mask).sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[math.exp(0.1), math.exp(0.1), 0.0]]))


def test_gspo_clips_the_whole_sequence():
    # Mean log ratio 0.4: exp(0.4) = 1.49 > 1.28, so every token of the sequence is clipped,
    # even one whose own ratio is 1.
    logp = torch.tensor([[0.8, 0.0]], requires_grad=True)
    loss, clipped = gspo_clipped_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor([[-1.28, -1.28]]))
    assert torch.equal(clipped, torch.ones(1, 2))
    loss.sum().backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))


def test_tis_weight_is_the_capped_ratio_of_trainer_to_engine():
    old = torch.tensor([-1.0, -1.0, -2.0])
    engine = torch.tensor([-1.5, -3.0, -1.0])
    assert torch.allclose(tis_weights(old, engine, cap=2.0), torch.tensor([math.exp(0.5), 2.0, math.exp(-1.0)]))


def test_tis_multiplies_the_policy_loss_by_its_weight_and_nothing_else():
    logp = torch.tensor([[-0.9, -2.1]])
    old = torch.tensor([[-1.0, -2.0]])
    engine = torch.tensor([[-1.5, -1.0]])
    args = dict(
        entropy=torch.zeros(1, 2),
        old_logp=old,
        engine_logp=engine,
        ref_logp=None,
        advantages=torch.tensor([[1.0, -1.0]]),
        mask=torch.ones(1, 2),
    )
    plain = token_losses(AlgorithmSpec(), logp, **args)
    with_tis = token_losses(AlgorithmSpec(tis_cap=1.5), logp, **args)
    # Per token: -A * ratio, ratio exp(0.1) and exp(-0.1) (both inside the clip band),
    # times min(exp(0.5), 1.5) and exp(-1).
    expected_plain = torch.tensor([[-math.exp(0.1), math.exp(-0.1)]])
    assert torch.allclose(plain.loss, expected_plain)
    assert torch.allclose(with_tis.loss, expected_plain * torch.tensor([[1.5, math.exp(-1.0)]]))
    # The weights are reported (train/tis_weight_mean, train/tis_clipped_fraction); the first is at the cap.
    assert plain.tis_weight is None and torch.allclose(with_tis.tis_weight, torch.tensor([[1.5, math.exp(-1.0)]]))
    assert torch.equal(with_tis.tis_weight >= 1.5, torch.tensor([[True, False]]))


def test_sft_loss_is_the_negative_log_likelihood_whatever_the_rl_inputs():
    logp = torch.tensor([[-0.5, -2.0]])
    args = dict(
        entropy=torch.ones(1, 2),
        old_logp=torch.zeros(1, 2),
        engine_logp=torch.zeros(1, 2),
        ref_logp=None,
        advantages=torch.tensor([[3.0, -3.0]]),
        mask=torch.ones(1, 2),
    )
    terms = token_losses(AlgorithmSpec(kind="sft", entropy_coef=0.5, tis_cap=1.5), logp, **args)
    assert torch.equal(terms.loss, torch.tensor([[0.5, 2.0]])) and terms.kl is None
    assert not terms.clipped.any()


def test_the_three_aggregations():
    values = torch.tensor([[1.0, 2.0, 7.0], [3.0, 7.0, 7.0]])
    # token mean: (1 + 2 + 3) / 3; sequence means of token means: (1.5 + 3) / 2; of token sums: (3 + 3) / 2.
    assert aggregate(values, MASK, LossAggregation.TOKEN_MEAN, tokens=3, global_samples=2).item() == 2.0
    assert aggregate(values, MASK, LossAggregation.SEQ_MEAN_TOKEN_MEAN, 3, 2).item() == 2.25
    assert aggregate(values, MASK, LossAggregation.SEQ_MEAN_TOKEN_SUM, 3, 2).item() == 3.0


def test_rollout_token_mean_divides_by_the_rollouts_tokens_per_step():
    # A rollout of 19 response tokens in 2 steps: a step of 9 tokens divides by 9.5, not by its own 9.
    assert loss_tokens(LossAggregation.ROLLOUT_TOKEN_MEAN, 9, 19, 2) == 9.5
    assert loss_tokens(LossAggregation.TOKEN_MEAN, 9, 19, 2) == 9
    values = torch.tensor([[1.0, 2.0, 7.0], [3.0, 7.0, 7.0]])
    assert aggregate(values, MASK, LossAggregation.ROLLOUT_TOKEN_MEAN, 4.0, 2).item() == 1.5


@pytest.mark.parametrize("how", list(LossAggregation))
def test_an_aggregation_summed_over_shards_is_the_whole_batch(how):
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=generator)
    mask = (torch.rand(6, 5, generator=generator) > 0.3).float()
    mask[:, 0] = 1.0
    tokens, samples = int(mask.sum()), 6
    whole = aggregate(values, mask, how, tokens, samples)
    for shards in (2, 3):
        parts = [
            aggregate(values[rows], mask[rows], how, tokens, samples) for rows in torch.arange(6).tensor_split(shards)
        ]
        assert torch.allclose(sum(parts), whole, atol=1e-6)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    log_probs = logits.log_softmax(-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def test_the_entropy_bonus_is_subtracted_and_raises_entropy_when_followed():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]], requires_grad=True)
    ent = entropy(logits)
    loss = policy_token_loss(torch.zeros_like(ent), ent, None, entropy_coef=0.1, kl_coef=0.0)
    assert loss.item() == pytest.approx(-0.1 * ent.item())
    loss.sum().backward()
    with torch.no_grad():
        stepped = logits - 1.0 * logits.grad
    assert entropy(stepped).item() > ent.item()


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_the_rl_objective_subtracts_entropy_coef_times_the_entropy(estimator):
    logp = torch.tensor([[-1.0, -2.0]])
    args = dict(
        entropy=torch.tensor([[0.7, 1.2]]),
        old_logp=logp,
        engine_logp=logp,
        ref_logp=None,
        advantages=torch.tensor([[1.0, -1.0]]),
        mask=torch.ones(1, 2),
    )
    terms = token_losses(AlgorithmSpec(advantage_estimator=estimator, entropy_coef=0.1), logp, **args)
    # Ratio 1 at both tokens: the policy loss is -A, i.e. -1 and 1; minus 0.1 times the entropies 0.7 and 1.2.
    assert torch.allclose(terms.loss, torch.tensor([[-1.0 - 0.07, 1.0 - 0.12]]))
    assert torch.allclose(terms.pg, torch.tensor([[-1.0, 1.0]]))


def test_kl_is_a_loss_term_unless_it_is_in_the_reward():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    args = dict(
        entropy=torch.zeros(1, 1),
        old_logp=logp,
        engine_logp=logp,
        ref_logp=ref,
        advantages=torch.zeros(1, 1),
        mask=torch.ones(1, 1),
    )
    as_loss = token_losses(AlgorithmSpec(kl_coef=0.2, kl_estimator="k1"), logp, **args)
    in_reward = token_losses(AlgorithmSpec(kl_coef=0.2, kl_estimator="k1", kl_in_reward=True), logp, **args)
    assert as_loss.loss.item() == pytest.approx(0.2 * 0.5)
    assert in_reward.loss.item() == 0.0
    assert in_reward.kl.item() == pytest.approx(0.5)


def test_the_engines_log_probs_as_the_old_policy_refuse_tis():
    with pytest.raises(ValueError, match="use_rollout_logprobs makes the same: drop one"):
        AlgorithmSpec(use_rollout_logprobs=True, tis_cap=2.0)
