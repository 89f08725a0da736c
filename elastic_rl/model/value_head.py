"""PPO's critic as a model: the policy's architecture with a value head, a scalar per position, on its
last stage.

The critic runs through the same passes as the policy (``model.pipeline``) and takes the same final hidden
states of the scored positions; where the policy applies its output layer to them (``model.token_scores``),
the critic applies its head. The value read at the position that predicts a response token is the value of
the state before that token, so values line up with the log probs token for token. The output layer is never
used: untied, it is frozen. Every tensor-parallel rank holds the head whole and, its hidden states being
whole too, computes the same values and the whole gradient: nothing is summed over those ranks.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

VALUE_HEAD = "value_head"
"""The head's name among the model's parameters (``value_head.weight``, ``value_head.bias``)."""


def attach_value_head(model: torch.nn.Module) -> None:
    """Give ``model`` (this rank's stage) a zero value head if it is the last stage, and freeze an untied
    output layer, which the critic never applies."""
    if not parallel_state.is_pipeline_last_stage():
        return
    head = torch.nn.Linear(model.config.hidden_size, 1, device=next(model.parameters()).device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    setattr(model, VALUE_HEAD, head)
    if not model.share_embeddings_and_output_weights:
        model.output_layer.requires_grad_(False)


def token_values(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 values ``[batch, positions]`` of the scored positions' final hidden states ``[batch, positions,
    hidden]``."""
    head = getattr(model, VALUE_HEAD)
    return torch.nn.functional.linear(hidden.float(), head.weight, head.bias).squeeze(-1)
