"""Per-token losses and their reduction over the global batch.

Each loss term is a small function of per-token tensors; ``reduce_global``
sums a term over this shard's response tokens and divides by the number of
response tokens in the *global* batch, so gradients summed across shards and
replicas equal the gradient of the global token mean, whatever the split.
"""

from __future__ import annotations

import torch


def ppo_clipped_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's policy loss with asymmetric PPO clipping; returns (loss, clipped) per token."""
    ratio = (logp - old_logp).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def ppo_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """The approximate KL(old || new) of the update, per token (0 before the first step)."""
    return old_logp - logp


def reduce_global(values: torch.Tensor, mask: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """Sum ``values`` over masked tokens, normalised by the global batch's token count."""
    return (values * mask).sum() / global_tokens
