"""The global gradient norm of a tensor- and pipeline-parallel model: what the trainer clips by and checks."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from elastic_rl.layer_names import is_tied_copy
from elastic_rl.model.pipeline import sum_over_stages


def grad_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """The global gradient norm: tensor-parallel shards summed across ranks, replicated ones once, every
    pipeline stage's share summed (a tied embedding counted once, on the first stage)."""
    device = parameters[0].device if parameters else None
    sharded = torch.zeros((), device=device)
    replicated = torch.zeros((), device=device)
    for param in parameters:
        if param.grad is None or is_tied_copy(param):
            continue
        values = param.grad.detach().reshape(-1).float()
        squares = torch.dot(values, values)  # one pass, no squared copy
        if getattr(param, "tensor_model_parallel", False):
            sharded += squares
        else:
            replicated += squares
    torch.distributed.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
    squares = sharded + replicated
    sum_over_stages(squares)
    return squares.sqrt()
