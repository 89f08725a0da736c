"""Per-token advantages for each estimator: GRPO and GSPO (group-normalised), REINFORCE++ and its
group-baseline variant (returns whitened over the rollout batch), PPO's (GAE over a critic's values,
whitened over the rollout batch), and on-policy distillation's term on top of any of them.

Every function here sees the whole rollout batch, which every replica holds, so each replica
computes the same advantages whatever share of the batch it then trains on.
"""

from __future__ import annotations

from dataclasses import dataclass

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


WHITEN_EPSILON = 1e-8
"""Added to the variance before its inverse square root, as slime's masked whitening does."""


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` shifted to mean 0 over the masked tokens and divided by their sample standard deviation
    (Bessel-corrected, as slime whitens REINFORCE++'s and PPO's advantages); 0 at unmasked tokens."""
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1)
    variance = (((values - mean) * mask) ** 2).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(variance + WHITEN_EPSILON) * mask


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


@dataclass(frozen=True)
class GaeResult:
    advantages: torch.Tensor
    """Whitened over the rollout's response tokens, 0 elsewhere."""
    returns: torch.Tensor
    """What the critic learns to predict: the raw (unwhitened) advantage plus the value, 0 off the mask."""


def final_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[batch, tokens]: each sequence's reward at its last response token, 0 elsewhere."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (mask * positions).argmax(dim=1)
    paid = torch.zeros_like(mask, dtype=torch.float32)
    paid[torch.arange(mask.shape[0], device=mask.device), last] = rewards.float()
    return paid * mask


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> GaeResult:
    """PPO's advantages: generalised advantage estimation over each response's tokens, in order.

    ``values``: [batch, tokens], the critic's value of the state before each token. The reward is paid at
    a sequence's last response token; ``token_kl``, when given, is a penalty of ``-kl_coef * kl`` at each
    token. Tokens off the mask (the prompt, a tool's output between turns) are skipped: the next kept
    token's value and advantage carry across them. The advantages are whitened over the whole batch.
    """
    mask = mask.float()
    paid = final_rewards(rewards, mask)
    if token_kl is not None:
        paid = paid - kl_coef * token_kl * mask
    values = values.float() * mask
    raw = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], device=values.device)
    running = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        kept = mask[:, t]
        delta = paid[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(kept > 0, step, running)
        next_value = torch.where(kept > 0, values[:, t], next_value)
        raw[:, t] = step * kept
    return GaeResult(whiten(raw, mask), (raw + values) * mask)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """How much of the returns' variance over the response tokens the values account for: 1 is all of it,
    0 no better than their mean, below 0 worse."""
    count = mask.sum().clamp(min=1)

    def variance(x: torch.Tensor) -> torch.Tensor:
        mean = (x * mask).sum() / count
        return (((x - mean) * mask) ** 2).sum() / count

    spread = variance(returns)
    if spread.item() == 0:
        return 0.0
    return (1 - variance(returns - values) / spread).item()
