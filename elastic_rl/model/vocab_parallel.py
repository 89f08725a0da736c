"""Log probabilities and entropy from logits sharded over the vocabulary.

With tensor parallelism each rank holds the logits of a slice of the
vocabulary. These functions reduce across the tensor-parallel group so every
rank gets the full-vocabulary answer, with gradients that flow back to each
rank's own slice. At tensor-parallel size 1 they are plain log-softmax maths.
They stand in for megatron's ``vocab_parallel_cross_entropy``, whose backward
allocates on the GPU, and give the RL losses the per-token log probabilities
and entropies they need.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)


def shard_bounds(shard: int) -> tuple[int, int]:
    """The vocabulary ids [start, end) this rank holds, ``shard`` of them."""
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    return start, start + shard


def normaliser(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits shifted by the global max, the log of the global partition function, and that max."""
    global_max = logits.detach().amax(dim=-1, keepdim=True)
    torch.distributed.all_reduce(
        global_max,
        op=torch.distributed.ReduceOp.MAX,
        group=parallel_state.get_tensor_model_parallel_group(),
    )
    shifted = logits - global_max
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1))
    return shifted, sum_exp.log(), global_max.squeeze(-1)


def picked(shifted: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The shifted logit of each target, from whichever rank holds it."""
    start, end = shard_bounds(shifted.shape[-1])
    local = (targets >= start) & (targets < end)
    index = (targets - start).clamp(0, end - start - 1).unsqueeze(-1)
    return reduce_from_tensor_model_parallel_region(shifted.gather(-1, index).squeeze(-1) * local)


def entropy_of(shifted: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    """The entropy at each position, from ``log_probs_and_normaliser``'s shifted logits and normaliser."""
    # Each rank's probabilities depend on the normaliser, which every rank's logits make: its gradient from
    # them is summed over the ranks (copy_to_tensor_model_parallel_region's backward) before it reaches
    # each rank's own logits through the normaliser.
    probs = (shifted - copy_to_tensor_model_parallel_region(log_z).unsqueeze(-1)).exp()
    return log_z - reduce_from_tensor_model_parallel_region((probs * shifted).sum(dim=-1))


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) for each position. ``logits``: [..., vocab/tp]; ``targets``: [...]."""
    return log_probs_and_normaliser(logits, targets)[0]


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the full-vocabulary distribution at each position."""
    return entropy_of(*normaliser(logits.float())[:2])


def log_probs_and_normaliser(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_log_probs``, with the shifted logits and log normaliser they came from, from which
    ``entropy_of`` gives the entropy without normalising the logits a second time."""
    shifted, log_z, _ = normaliser(logits.float())
    return picked(shifted, targets) - log_z, shifted, log_z


@torch.no_grad()
def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary logits on every rank (no gradient: for evaluation and checks)."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1:
        return logits
    shards = [torch.empty_like(logits) for _ in range(world)]
    torch.distributed.all_gather(shards, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)
