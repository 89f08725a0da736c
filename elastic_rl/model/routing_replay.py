"""Rollout routing replay: a mixture of experts' routers in the trainer choose each token's experts as the
engine did (``algorithm.routing_replay``).

megatron-core's hook for it is the ``RouterReplay`` its top-k routing asks
for each layer's choice (``moe_utils.topk_routing_with_score_function``). Its
instances sit in one process-wide list, while a trainer process builds
several models (the policy, the reference, a teacher). So the trainer does
not turn megatron's switch on: ``RoutingReplay.attach`` gives the routers of
one model a ``LayerReplay`` each (a ``RouterReplay`` kept out of that list),
and ``replaying`` hands them a micro-batch's routing for its forward pass.

A micro-batch's routing is laid out as its tokens (``model.packing``), with
``routing_record.NO_ROUTE`` where the engine routed nothing (a sample's last token,
padding): those tokens the router chooses for itself. The scores of the
replayed experts are the router's own, so the gradient and the load-balancing
loss flow as they do without replay, and ``ExpertLoad`` counts the replayed
choices.

Under full recomputation (``trainer.recompute: full``) a layer's forward runs
again inside the backward pass: each forward of a pass that will have one
(``replaying`` entered with gradients on; megatron's checkpointed forward
itself runs without) queues its routing, and the recomputed forward (the
autograd engine is running) takes the oldest. Both megatron schedules run the
backward passes of micro-batches in the order of their forwards.

While ``counting`` the replay also counts how many (token, layer) choices the
router would have made itself: ``train/routing_agreement``.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from elastic_rl.model.expert_load import replica_groups
from elastic_rl.routing_record import NO_ROUTE


class LayerReplay(RouterReplay):
    """One router's replay: the engine's choice where it made one, the router's own elsewhere."""

    def __init__(self, owner: RoutingReplay, moe_layer: int):
        # Not RouterReplay.__init__: that registers the instance in megatron's process-wide list.
        self.owner = owner
        self.moe_layer = moe_layer
        self.target_topk_idx: torch.Tensor | None = None
        self.recorded_topk_idx = None
        self.router_replay_action: RouterReplayAction | None = None
        self.replay_backward_list: list[torch.Tensor] = []

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self._target(scores)
        if target is None:
            return own_probs, own
        known = target[:, 0] != NO_ROUTE
        chosen = torch.where(known.unsqueeze(1), target, own)
        if self.owner.counting:
            same = (chosen.sort(dim=1).values == own.sort(dim=1).values).all(dim=1)
            self.owner.agreed += (same & known).sum()
            self.owner.replayed += known.sum()
        return scores.gather(1, chosen), chosen

    def _target(self, scores: torch.Tensor) -> torch.Tensor | None:
        if torch._C._current_graph_task_id() != -1:  # a forward recomputed inside the backward pass
            return self.replay_backward_list.pop(0) if self.replay_backward_list else None
        target = self.target_topk_idx
        if target is None:
            return None
        target = target.to(scores.device)
        if self.owner.queuing:
            self.replay_backward_list.append(target)
        return target


class RoutingReplay:
    """The replay of one model's routers (this rank's: a pipeline stage's layers)."""

    def __init__(self, routers: list[TopKRouter], recomputed: bool, device: torch.device, *, sequence_parallel: bool):
        self.recomputed = recomputed
        self.sequence_parallel = sequence_parallel
        """The routers see this tensor-parallel rank's slice of the sequence."""
        self.queuing = False
        """Inside ``replaying`` for a pass whose backward recomputes the forward."""
        self.counting = False
        self.agreed = torch.zeros((), dtype=torch.float64, device=device)
        self.replayed = torch.zeros((), dtype=torch.float64, device=device)
        self.layers: list[LayerReplay] = []
        for router in routers:
            # Every layer of the models built here routes, so a router's MoE layer is its layer.
            layer = LayerReplay(self, router.layer_number - 1)
            router.router_replay = layer
            self.layers.append(layer)

    @classmethod
    def attach(cls, model: torch.nn.Module) -> RoutingReplay | None:
        """Replay for ``model``'s routers, kept as ``model.routing_replay`` (where ``replaying`` finds it);
        None for a dense model."""
        routers = [module for module in model.modules() if isinstance(module, TopKRouter)]
        if not routers:
            return None
        config = model.config
        recomputed = config.recompute_granularity == "full"
        device = next(model.parameters()).device
        model.routing_replay = cls(routers, recomputed, device, sequence_parallel=config.sequence_parallel)
        return model.routing_replay

    @contextlib.contextmanager
    def replaying(self, routing: torch.Tensor | None):
        """Inside the block a forward routes as ``routing`` says: ``[batch, seq, layers, topk]`` as the
        model's input tokens (int64, ``NO_ROUTE`` where the router chooses); None: as the router would."""
        if routing is not None:
            # megatron's router sees the tokens as [seq * batch, hidden], sequence-major; under sequence
            # parallelism this rank's slice of the sequence.
            by_token = routing.transpose(0, 1)
            if self.sequence_parallel:
                ranks = parallel_state.get_tensor_model_parallel_world_size()
                by_token = by_token.chunk(ranks)[parallel_state.get_tensor_model_parallel_rank()]
            by_token = by_token.flatten(0, 1)
            for layer in self.layers:
                layer.target_topk_idx = by_token[:, layer.moe_layer]
            self.queuing = self.recomputed and torch.is_grad_enabled()
        try:
            yield
        finally:
            self.queuing = False
            for layer in self.layers:
                layer.target_topk_idx = None

    @contextlib.contextmanager
    def counting_agreement(self):
        """Count, inside the block, the replayed choices the routers would have made themselves."""
        self.counting = True
        try:
            yield
        finally:
            self.counting = False

    def take_agreement(self) -> float | None:
        """The share of (token, layer) choices counted since the last call that the routers would have made
        themselves, over the replica's ranks; None when none was counted. Every rank of the replica calls it."""
        counts = torch.stack([self.agreed, self.replayed])
        for group in replica_groups(sequence_slices=self.sequence_parallel):
            torch.distributed.all_reduce(counts, group=group)
        self.agreed.zero_()
        self.replayed.zero_()
        agreed, replayed = counts.tolist()
        return agreed / replayed if replayed else None


def replaying(model: torch.nn.Module, routing: torch.Tensor | None):
    """``RoutingReplay.replaying`` for ``model`` when it replays (``attach``ed), else nothing."""
    replay = getattr(model, "routing_replay", None)
    if replay is None:
        return contextlib.nullcontext()
    return replay.replaying(routing)
