"""Gathers a tensor-parallel megatron model into one full, TP-independent state.

Each rank holds slices of the tensor-parallel weights (megatron marks them with
``tensor_model_parallel`` and ``partition_dim``). ``full_state_dict`` gathers the
slices so that the result is exactly the state a TP=1 model would hold. The one
weight whose layout depends on TP is the gated MLP's ``linear_fc1``: each rank
stores [its gate rows; its up rows], and the full layout is [all gate; all up].
Converters to other formats start from this canonical state. With pipeline
stages, each stage names its layers as the whole model does (``model.stages``)
and the stages' states are put together on every rank; with expert
parallelism, the expert-parallel ranks' experts alike.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from elastic_rl.architecture import GATED_FC1_SUFFIX
from elastic_rl.layer_names import is_split_over_experts, is_tied_copy, whole_model_parameters


def _gather(shard: torch.Tensor, dim: int) -> list[torch.Tensor]:
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1:
        return [shard]
    shards = [torch.empty_like(shard) for _ in range(world)]
    torch.distributed.all_gather(shards, shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return shards


@torch.no_grad()
def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters in the TP=1, PP=1 layout, in CPU memory, on every rank of the model.
    Slices are gathered on the model's device, which is the tensor-parallel group's."""
    state: dict[str, torch.Tensor] = {}
    own_experts: list[str] = []
    for name, param in whole_model_parameters(model):
        if is_split_over_experts(param):
            own_experts.append(name)
        if is_tied_copy(param):
            continue  # the first stage gathers the embedding it copies: no second gather of a vocabulary's rows
        value = param.detach().float()  # exported as float32, bf16 parameters too
        if not getattr(param, "tensor_model_parallel", False):
            state[name] = value.to("cpu", copy=True)
            continue
        shards = _gather(value, param.partition_dim)
        if name.endswith(GATED_FC1_SUFFIX):
            halves = [shard.chunk(2, dim=0) for shard in shards]
            full = torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
        else:
            full = torch.cat(shards, dim=param.partition_dim)
        state[name] = full.cpu()
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        experts = [{}] * parallel_state.get_expert_model_parallel_world_size()
        own = {name: state[name] for name in own_experts}
        torch.distributed.all_gather_object(experts, own, group=parallel_state.get_expert_model_parallel_group())
        state.update({name: value for rank_experts in experts for name, value in rank_experts.items()})
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return state
    stages: list[dict[str, torch.Tensor]] = [{}] * parallel_state.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(stages, state, group=parallel_state.get_pipeline_model_parallel_group())
    return {name: value for stage_state in stages for name, value in stage_state.items()}
