"""Per-token advantages for each estimator: GRPO and GSPO (group-normalised), REINFORCE++ and its
group-baseline variant (returns whitened over the rollout batch), and on-policy distillation's term
on top of any of them.

Every function here sees the whole rollout batch, which every replica holds, so each replica
computes the same advantages whatever share of the batch it then trains on.
"""

from __future__ import annotations

import torch

from elastic_rl.spec.algorithm import AdvantageEstimator

EPSILON = 1e-6


def distilled(
    advantages: torch.Tensor, student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """On-policy distillation (slime's OPD): each response token's advantage lowered by ``coef`` times the
    reverse KL to the teacher at that token, the student's log prob minus the teacher's. A token the teacher
    finds likelier than the student gains; one it finds unlikely loses."""
    return advantages - coef * (student_logp - teacher_logp) * mask


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_by_std: bool = True, std_epsilon: float = EPSILON
) -> torch.Tensor:
    """Per-sample advantages. ``rewards``: [num_groups * group_size], groups contiguous; ``std_epsilon`` is
    added to each group's (unbiased) standard deviation before dividing by it.

    A group whose rewards are all equal carries no signal: its advantages are 0.
    """
    grouped = _groups(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + std_epsilon)
    return centred.reshape(-1)


def group_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each reward minus its group's mean (REINFORCE++-baseline's baseline)."""
    grouped = _groups(rewards, group_size)
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


def returns_to_go(rewards: torch.Tensor, token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Undiscounted return of each response token: the sequence's reward (paid at its end) plus the
    per-token rewards from that token on. ``token_rewards``, ``mask``: [batch, tokens]."""
    future = (token_rewards * mask).flip(1).cumsum(1).flip(1)
    return (rewards.float().unsqueeze(1) + future) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` shifted and scaled to mean 0 and standard deviation 1 over the masked tokens."""
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    variance = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) / (variance.sqrt() + EPSILON) * mask


def token_advantages(
    estimator: AdvantageEstimator,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    normalize_by_std: bool = True,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    std_epsilon: float = EPSILON,
) -> torch.Tensor:
    """[batch, tokens] advantages of the response tokens (0 elsewhere).

    ``token_kl`` (per token, KL to the reference), when given, is a penalty in the reward: the
    group estimators subtract ``kl_coef`` times each sequence's summed KL from its reward; the
    REINFORCE++ ones pay ``-kl_coef * kl`` at each token, so a token's return holds the KL still ahead.
    """
    kl = torch.zeros_like(mask) if token_kl is None else token_kl * mask
    if estimator in (AdvantageEstimator.GRPO, AdvantageEstimator.GSPO):
        penalised = rewards.float() - kl_coef * kl.sum(dim=1)
        return grpo_advantages(penalised, group_size, normalize_by_std, std_epsilon).unsqueeze(1) * mask
    if estimator is AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE:
        rewards = group_baseline(rewards, group_size)
    return whiten(returns_to_go(rewards, -kl_coef * kl, mask), mask)
