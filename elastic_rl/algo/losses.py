"""Per-token policy losses and their aggregation over the global batch.

Small functions over shared pieces: the clipped surrogate on a ratio, the ratio per token (PPO)
or per sequence (GSPO), truncated importance weights (TIS), off-policy sequence masking (OPSM), and
``aggregate``, which turns per-token values into the step's loss. Each aggregation divides by a count of the *global*
batch (its tokens or its samples), so gradients summed across shards and replicas equal the
gradient of the whole batch's loss, whatever the split.
"""

from __future__ import annotations

import torch

from elastic_rl.spec.algorithm import LossAggregation


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped objective as a loss, with asymmetric clipping; returns (loss, clipped)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def ppo_clipped_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped loss on each token's own ratio (GRPO, REINFORCE++); returns (loss, clipped) per token."""
    return clipped_surrogate((logp - old_logp).exp(), advantages, eps_clip, eps_clip_high)


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's importance ratio, per token: its value is the sequence's length-normalised ratio
    exp(mean over response tokens of (logp - old_logp)); its gradient flows through each token's
    own log prob, scaled by that value."""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    sequence = (((logp - old_logp) * mask).sum(dim=1, keepdim=True) / lengths).detach().exp()
    return sequence * (logp - logp.detach()).exp()


def gspo_clipped_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the clipped loss on the sequence-level ratio, so a sequence is clipped as a whole."""
    return clipped_surrogate(sequence_ratio(logp, old_logp, mask), advantages, eps_clip, eps_clip_high)


def tis_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: per token, pi_trainer / pi_engine for the sampled token,
    capped at ``cap``. It corrects for the engine having sampled from a slightly different
    policy (another precision, or older weights in async mode); no gradient flows through it."""
    return (old_logp - engine_logp).exp().clamp(max=cap).detach()


def off_policy_sequence_mask(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, delta: float
) -> torch.Tensor:
    """Off-policy sequence masking (OPSM), per token: 1 where a token is masked out of the policy gradient.

    A token is masked when its advantage is negative and its sequence has drifted from the old policy by
    more than ``delta``: the mean over the sequence's response tokens of (old_logp - logp). Pushing down a
    sequence the policy has already moved away from teaches little and destabilises, so those tokens are
    dropped; a sequence with a positive advantage is always kept. No gradient flows through the mask."""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    drift = ((old_logp - logp.detach()) * mask).sum(dim=1, keepdim=True) / lengths
    return ((advantages < 0) & (drift > delta)).float() * mask


def ppo_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """The approximate KL(old || new) of the update, per token (0 before the first step)."""
    return old_logp - logp


def policy_token_loss(
    pg: torch.Tensor,
    entropy: torch.Tensor,
    kl: torch.Tensor | None,
    entropy_coef: float,
    kl_coef: float,
) -> torch.Tensor:
    """Per token: the policy-gradient loss, minus the entropy bonus, plus the KL penalty (when KL is a loss term)."""
    loss = pg - entropy_coef * entropy
    return loss if kl is None else loss + kl_coef * kl


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, how: LossAggregation, tokens: float, global_samples: int
) -> torch.Tensor:
    """This shard's share of the global batch's loss, for per-token ``values`` [batch, tokens]. ``tokens``: what
    a token mean divides by (``loss_tokens``)."""
    masked = values * mask
    if how in (LossAggregation.TOKEN_MEAN, LossAggregation.ROLLOUT_TOKEN_MEAN):
        return masked.sum() / tokens
    per_sequence = masked.sum(dim=1)
    if how is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        per_sequence = per_sequence / mask.sum(dim=1).clamp(min=1)
    return per_sequence.sum() / global_samples


def loss_tokens(how: LossAggregation, step_tokens: int, rollout_tokens: int, steps: int) -> float:
    """What a token-mean loss divides by: the step's global batch's response tokens, or for
    ``rollout_token_mean`` the rollout's mean per step (so every token of the rollout weighs the same)."""
    return rollout_tokens / steps if how is LossAggregation.ROLLOUT_TOKEN_MEAN else step_tokens


def reduce_global(values: torch.Tensor, mask: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """Sum ``values`` over masked tokens, normalised by the global batch's token count (the metrics' reduction)."""
    return (values * mask).sum() / global_tokens


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss per token: half the larger squared error to the return of the value and of the value
    kept within ``clip`` of the old one, so one step cannot move a value far; returns (loss, clipped), clipped
    1 where the kept-close value's error is the larger."""
    kept_close = old_values + (values - old_values).clamp(-clip, clip)
    free = (values - returns) ** 2
    held = (kept_close - returns) ** 2
    return 0.5 * torch.maximum(free, held), (held > free).float()
