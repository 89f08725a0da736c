"""The policy's log prob and entropy of every token of whole sequences, given each token's prefix.

What the trainer scores a rollout with: the old policy before a rollout's first
step, the reference, and the policy under training at every step.
"""

from __future__ import annotations

import torch

from elastic_rl.model.gpt import forward_gpt, model_device
from elastic_rl.model.vocab_parallel import log_probs_and_entropy


def sequence_log_probs(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    temperature: float,
    first: int = 1,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, entropy) of each token given its prefix, aligned to ``tokens``, in fp32 on the model's
    device, whatever precision the forward pass ran in. Only positions from ``first`` on are scored
    (a batch's shortest prompt: no response token comes earlier); the ones before are 0 and cost
    no logits. Without ``entropy_grad`` the entropy carries no gradient (it is then a metric)."""
    tokens = tokens.to(model_device(model))
    # fp32 before the temperature: a bf16 quotient would be rounded to bf16's 8 bits of mantissa.
    logits = forward_gpt(model, tokens[:, :-1], first_logit=first - 1).float()
    if temperature > 0:
        logits = logits / temperature
    logp, ent = log_probs_and_entropy(logits, tokens[:, first:], entropy_grad)
    pad = torch.zeros(tokens.shape[0], first, device=logp.device)
    return torch.cat([pad, logp], dim=1), torch.cat([pad, ent], dim=1)
