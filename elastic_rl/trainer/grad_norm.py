"""The gradient norm over a replica's tensor-, expert- and pipeline-parallel ranks: what the trainer clips by."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from elastic_rl.layer_names import is_split_over_experts, is_tied_copy
from elastic_rl.model.pipeline import sum_over_stages


def gradient_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """Where ``param``'s gradient adds up: ``.grad``, or with bf16 parameters megatron's fp32 ``main_grad``."""
    return getattr(param, "main_grad", param.grad)


def grad_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """The global gradient norm: tensor-parallel shards summed across ranks, replicated ones once, each
    expert-parallel rank's experts summed across those ranks, every pipeline stage's share summed (a tied
    embedding counted once, on the first stage)."""
    device = parameters[0].device if parameters else None
    # Squares by placement: [split over tensor-parallel ranks or not][split over expert-parallel ranks or not].
    squares = torch.zeros(2, 2, device=device)
    for param in parameters:
        gradient = gradient_of(param)
        if gradient is None or is_tied_copy(param):
            continue
        values = gradient.detach().reshape(-1).float()
        tensor_split = getattr(param, "tensor_model_parallel", False)
        squares[int(tensor_split), int(is_split_over_experts(param))] += torch.dot(values, values)
    split = squares[1].contiguous()
    torch.distributed.all_reduce(split, group=parallel_state.get_tensor_model_parallel_group())
    squares[1] = split
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        experts = squares[:, 1].contiguous()
        torch.distributed.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
        squares[:, 1] = experts
    total = squares.sum()
    sum_over_stages(total)
    return total.sqrt()
