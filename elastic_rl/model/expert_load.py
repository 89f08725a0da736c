"""Counts the tokens a mixture of experts' routers send to each expert: the trainer's expert-load metrics.

A mixture of experts learns well only while each layer's router spreads the
tokens over its experts; one that sends most of them to a few starves the
rest. ``ExpertLoad`` hooks every router of a model (megatron's ``TopKRouter``,
whose forward returns each token's chosen experts as ``routing_map``) and,
while ``counting``, adds up each layer's tokens per expert, the layers numbered
as in the whole model. Every position the router scores counts, a micro-batch's
padding included: the router is given no mask.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter


def replica_groups(*, sequence_slices: bool) -> list:
    """The groups over which a count of routed tokens is summed to the replica's: its data-parallel ranks and
    stages, and with ``sequence_slices`` (sequence parallelism) its tensor-parallel ranks, each of which
    routes its slice of the sequence. Only groups of more than one rank."""
    groups = [parallel_state.get_data_parallel_group(), parallel_state.get_pipeline_model_parallel_group()]
    if sequence_slices:
        groups.append(parallel_state.get_tensor_model_parallel_group())
    return [group for group in groups if torch.distributed.get_world_size(group) > 1]


class ExpertLoad:
    def __init__(
        self,
        routers: list[TopKRouter],
        num_layers: int,
        experts: int,
        device: torch.device,
        *,
        sequence_parallel: bool = False,
    ):
        # On the model's device: the sums over the replica's ranks run on its groups' backend.
        self.tokens = torch.zeros(num_layers, experts, dtype=torch.float64, device=device)
        self.sequence_parallel = sequence_parallel
        """Each tensor-parallel rank routes its slice of the sequence: their counts are summed too."""
        self._counting = False
        for router in routers:
            router.register_forward_hook(functools.partial(self._count, router.layer_number - 1))

    @classmethod
    def of(cls, model: torch.nn.Module) -> ExpertLoad | None:
        """The counter of ``model``'s routers; None for a dense model."""
        routers = [module for module in model.modules() if isinstance(module, TopKRouter)]
        if not routers:
            return None
        config = model.config
        device = next(model.parameters()).device
        return cls(
            routers, config.num_layers, config.num_moe_experts, device, sequence_parallel=config.sequence_parallel
        )

    def _count(self, layer: int, _router, _inputs, outputs) -> None:
        if self._counting:
            _, routing_map = outputs
            self.tokens[layer] += routing_map.sum(dim=0)

    @contextlib.contextmanager
    def counting(self):
        """Count the tokens routed inside the block (the training passes, not the old policy's)."""
        self._counting = True
        try:
            yield
        finally:
            self._counting = False

    def take_metrics(self) -> dict[str, float]:
        """Each layer's busiest expert's tokens over the mean of its experts' (1: even), and the largest
        over the layers, for the tokens counted since the last call (summed over the replica's
        data-parallel ranks and stages, and its tensor-parallel ranks under sequence parallelism); then
        starts counting afresh. Every rank of the replica calls it."""
        tokens = self.tokens
        for group in replica_groups(sequence_slices=self.sequence_parallel):
            torch.distributed.all_reduce(tokens, group=group)
        self.tokens = torch.zeros_like(tokens)
        mean = tokens.mean(dim=1).clamp_min(1e-12)
        per_layer = (tokens.max(dim=1).values / mean).tolist()
        metrics = {f"train/expert_load_max_over_mean/layer_{layer}": load for layer, load in enumerate(per_layer)}
        metrics["train/expert_load_max_over_mean"] = max(per_layer)
        return metrics
