"""Advantages, the clipped policy loss and the KL estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from elastic_rl.algo.advantages import grpo_advantages
from elastic_rl.algo.kl import k1, k2, k3, low_var_kl
from elastic_rl.algo.losses import ppo_clipped_loss, ppo_kl, reduce_global

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_grpo_advantages_centre_and_scale_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    advantages = grpo_advantages(rewards, group_size=4)
    # Group 1: mean 0.25, sample std sqrt(0.25) = 0.5.
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5])
    assert torch.allclose(advantages[:4], expected, atol=1e-5)
    # Group 2 has equal rewards: no signal.
    assert torch.equal(advantages[4:], torch.zeros(4))


def test_grpo_advantages_without_std():
    advantages = grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2, normalize_by_std=False)
    assert torch.allclose(advantages, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_grpo_advantages_need_whole_groups():
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(5), group_size=2)


def test_ppo_loss_unclipped_inside_the_trust_region():
    logp, old = torch.tensor([math.log(1.1)]), torch.tensor([0.0])
    loss, clipped = ppo_clipped_loss(logp, old, torch.tensor([2.0]), eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-2.2)
    assert clipped.item() == 0.0


def test_ppo_loss_clips_high_for_positive_advantage():
    logp, old = torch.tensor([math.log(1.5)]), torch.tensor([0.0])
    loss, clipped = ppo_clipped_loss(logp, old, torch.tensor([1.0]), eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    assert clipped.item() == 1.0


def test_ppo_loss_clips_low_for_negative_advantage():
    logp, old = torch.tensor([math.log(0.5)]), torch.tensor([0.0])
    loss, clipped = ppo_clipped_loss(logp, old, torch.tensor([-1.0]), eps_clip=0.2, eps_clip_high=0.28)
    # max(-A * 0.5, -A * 0.8) = max(0.5, 0.8) = 0.8
    assert loss.item() == pytest.approx(0.8)
    assert clipped.item() == 1.0


def test_ppo_loss_keeps_the_pessimistic_side():
    # Negative advantage, ratio above the band: the unclipped term is larger and is kept.
    logp, old = torch.tensor([math.log(2.0)]), torch.tensor([0.0])
    loss, clipped = ppo_clipped_loss(logp, old, torch.tensor([-1.0]), eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(2.0)
    assert clipped.item() == 0.0


def test_ppo_kl_is_zero_for_identical_policies():
    logp = torch.tensor([-1.0, -2.0])
    assert torch.equal(ppo_kl(logp, logp.clone()), torch.zeros(2))


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert k1(logp, ref).item() == pytest.approx(0.5)
    assert k2(logp, ref).item() == pytest.approx(0.125)
    assert k3(logp, ref).item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert low_var_kl(logp, ref).item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)


def test_low_var_kl_is_clamped():
    assert low_var_kl(torch.tensor([-20.0]), torch.tensor([0.0])).item() == 10.0


def test_k3_is_non_negative_and_zero_at_equality():
    logp = torch.linspace(-3, 0, 7)
    assert torch.all(k3(logp, logp.flip(0)) >= 0)
    assert torch.equal(k3(logp, logp), torch.zeros(7))


def test_reduce_global_normalises_by_the_global_token_count():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert reduce_global(values, mask, global_tokens=10).item() == pytest.approx((2 + 3 + 4) / 10)
