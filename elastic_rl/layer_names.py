"""A pipeline stage's parameters under the names the whole model gives them.

Below the model package, so that snapshots (``checkpoints``) name what they
save as the model does.

megatron numbers a stage's layers from 0 (``decoder.layers.0`` on every stage),
and each layer knows its place in the whole model (``layer_number``, counted
from 1). The canonical state, exports and comparisons across layouts name
layers as the whole model does. With a tied embedding the last stage holds a
copy of the first stage's embedding as its output layer (megatron marks it
``shared``), which goes by the embedding's name: the two stages sum their
gradients of it and step it alike, so it always holds the embedding's values.
With expert parallelism a rank holds some of each layer's experts, numbered
from 0 (``mlp.experts.local_experts.0``); they go by the whole model's expert
numbers, which megatron's MoE layer knows (``local_expert_indices``).
"""

from __future__ import annotations

import re

import torch

EMBEDDING = "embedding.word_embeddings.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def layer_offset(model: torch.nn.Module) -> int:
    """How many layers of the whole model come before this stage's first."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def first_expert(model: torch.nn.Module) -> int:
    """The whole model's number of this rank's first expert in each layer (0 without expert parallelism)."""
    return next(
        (module.local_expert_indices[0] for module in model.modules() if hasattr(module, "local_expert_indices")), 0
    )


def whole_model_name(name: str, offset: int, expert_offset: int = 0) -> str:
    """A stage's parameter name as the whole model names it."""
    name = _LAYER.sub(lambda match: f"decoder.layers.{int(match.group(1)) + offset}.", name)
    return _LOCAL_EXPERT.sub(lambda match: f".mlp.experts.local_experts.{int(match.group(1)) + expert_offset}.", name)


def is_tied_copy(param: torch.nn.Parameter) -> bool:
    """The last stage's copy of a tied embedding."""
    return getattr(param, "shared", False)


def whole_model_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """This stage's parameters under the whole model's names; a tied embedding's copy under the
    embedding's, whose values it always holds."""
    offset, expert_offset = layer_offset(model), first_expert(model)
    return [
        (EMBEDDING if is_tied_copy(param) else whole_model_name(name, offset, expert_offset), param)
        for name, param in model.named_parameters()
    ]


@torch.no_grad()
def take_stage(stage: torch.nn.Module, whole: torch.nn.Module) -> None:
    """Fill ``stage`` from ``whole``, this rank's model with every layer (at the same tensor-parallel rank)."""
    source = dict(whole.named_parameters())
    for name, param in whole_model_parameters(stage):
        param.copy_(source[name])


def is_split_over_experts(param: torch.nn.Parameter) -> bool:
    """One of this rank's experts under expert parallelism: the other expert-parallel ranks hold others
    (megatron marks such a parameter ``allreduce`` False: it is not summed over the data-parallel ranks)."""
    return not getattr(param, "allreduce", True)


def is_summed_over_tensor_ranks(name: str, param: torch.nn.Parameter) -> bool:
    """A parameter every tensor-parallel rank holds whole while its gradient there is only a share, summed
    over the ranks: Qwen3's per-head q/k norm (each rank applies it to its own heads), and under sequence
    parallelism what sees this rank's slice of the sequence (megatron marks it ``sequence_parallel``: the
    norms of the hidden states, a mixture of experts' routers)."""
    heads = name.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"))
    return heads or getattr(param, "sequence_parallel", False)


def summed_over_tensor_ranks(model: torch.nn.Module, tensor_ranks: int) -> list[torch.nn.Parameter]:
    """``model``'s trained parameters whose gradients are summed over its ``tensor_ranks`` ranks after the
    backward pass (``is_summed_over_tensor_ranks``); none at one rank."""
    return [
        param
        for name, param in model.named_parameters()
        if param.requires_grad and tensor_ranks > 1 and is_summed_over_tensor_ranks(name, param)
    ]
