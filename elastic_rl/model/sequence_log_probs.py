"""The policy's log prob and entropy of every token of whole sequences, given each token's prefix.

What the trainer's passes compute for each micro-batch (the old policy before a
rollout's first step, the reference, the policy under training), here for rows
of equal length: checks and benchmarks score sequences with it.
"""

from __future__ import annotations

import torch

from elastic_rl.model.gpt import decoder_states, model_device
from elastic_rl.model.packing import ModelInput
from elastic_rl.model.token_scores import Entropy, token_scores


def sequence_log_probs(
    model: torch.nn.Module, tokens: torch.Tensor, temperature: float, first: int = 1, entropy: Entropy = Entropy.LOSS
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p, entropy) of each token given its prefix, aligned to ``tokens`` ``[batch, seq]``, in fp32 on
    the model's device, whatever precision the forward pass ran in; the entropy is None with
    ``Entropy.NONE``. Only positions from ``first`` on are scored (a batch's shortest prompt: no response
    token comes earlier); the ones before are 0 and cost no logits."""
    tokens = tokens.to(model_device(model))
    item = ModelInput(tokens[:, :-1], tokens[:, first:], rows=tokens.shape[0], first=first - 1)
    logp, ent = token_scores(model, decoder_states(model, item), item.targets, temperature, entropy)
    width = tokens.shape[1]
    return item.spread(logp, width), None if ent is None else item.spread(ent, width)
