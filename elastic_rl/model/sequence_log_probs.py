"""The policy's log prob and entropy of every token of whole sequences, given each token's prefix.

What the trainer scores a rollout with: the old policy before a rollout's first
step, the reference, and the policy under training at every step.
"""

from __future__ import annotations

from enum import Enum

import torch

from elastic_rl.model.gpt import forward_gpt, model_device
from elastic_rl.model.vocab_parallel import entropy_of, log_probs_and_normaliser


class Entropy(Enum):
    """What a pass needs of the entropy: each costs a pass over the vocabulary-wide logits."""

    NONE = "none"
    """Not computed (the old-policy and reference passes)."""
    METRIC = "metric"
    """Reported: computed without a gradient."""
    LOSS = "loss"
    """In the loss (an entropy bonus): with its gradient."""


def sequence_log_probs(
    model: torch.nn.Module, tokens: torch.Tensor, temperature: float, first: int = 1, entropy: Entropy = Entropy.LOSS
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p, entropy) of each token given its prefix, aligned to ``tokens``, in fp32 on the model's
    device, whatever precision the forward pass ran in; the entropy is None with ``Entropy.NONE``.
    Only positions from ``first`` on are scored (a batch's shortest prompt: no response token comes
    earlier); the ones before are 0 and cost no logits."""
    tokens = tokens.to(model_device(model))
    return log_probs_of_logits(
        forward_gpt(model, tokens[:, :-1], first_logit=first - 1), tokens, temperature, first, entropy
    )


def log_probs_of_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, first: int, entropy: Entropy
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sequence_log_probs`` from the logits of positions ``first - 1`` on (a pipeline's last stage has them)."""
    # fp32 before the temperature: a bf16 quotient would be rounded to bf16's 8 bits of mantissa.
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    logp, shifted, log_z = log_probs_and_normaliser(logits, tokens[:, first:])
    pad = torch.zeros(tokens.shape[0], first, device=logp.device)
    if entropy is Entropy.NONE:
        return torch.cat([pad, logp], dim=1), None
    with torch.set_grad_enabled(entropy is Entropy.LOSS and torch.is_grad_enabled()):
        ent = entropy_of(shifted, log_z)
    return torch.cat([pad, logp], dim=1), torch.cat([pad, ent], dim=1)
