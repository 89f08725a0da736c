"""PPO's critic in training: its value model, optimizer and schedule, held in the policy's own ranks.

The critic lives beside the policy rather than in replicas of its own: every rank of every replica
holds its share of the critic at the policy's layout (tensor, pipeline and data-parallel ranks), and
each step of the torchft quorum trains both on the same micro-batches. Its gradients are summed over
the replica's data-parallel ranks and across replicas in the step's all-reduce, a replica's NaN verdict
covers the value loss, and the Manager commits both steps or neither. So a killed rank costs the critic
what it costs the policy: the replica heals both from a peer (``TrainerReplica.heal_state``) or resumes
both from a snapshot, which saves the critic under ``critic.`` (``checkpoints.snapshot``), and
``erl resume --set`` reshards both alike. Its own quorum would add a second group to restart and heal
for no gain: the critic's step needs the rollout the policy's does, at the same time.

The value model is ``model.value_head``'s; its values are read before the rollout's first step (the old
values GAE takes) and trained toward the returns with a clipped loss, aggregated as the policy's loss is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state

from checkpoints.snapshot import TrainingState
from elastic_rl.algo.losses import clipped_value_loss, reduce_global
from elastic_rl.layer_names import summed_over_tensor_ranks
from elastic_rl.model.pipeline import run_micro_batches, sum_over_stages
from elastic_rl.model.value_head import token_values
from elastic_rl.spec.job import JobSpec
from elastic_rl.trainer.grad_norm import grad_norm
from elastic_rl.trainer.gradient_buffer import view_gradients
from elastic_rl.trainer.lr_schedule import lr_lambda
from elastic_rl.trainer.micro_batches import MicroBatch
from elastic_rl.trainer.optimizer import build_optimizer, load_trained_state, local_optimizer, trained_state

Aggregate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(per-token values, mask) -> this shard's share of the step's loss, as the policy's loss is aggregated."""


class Critic:
    """This rank's share of the critic: the value model, its optimizer and schedule, and its gradients in
    one flat buffer (each ``.grad`` a view of it) for the step's all-reduce."""

    def __init__(self, spec: JobSpec, model: torch.nn.Module, total_steps: int):
        self.settings = spec.algorithm.critic
        self.model = model
        trainer = self.settings.as_trainer(spec.trainer)
        self.optimizer = build_optimizer(model, trainer)
        self.local_optimizer = local_optimizer(self.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(trainer, total_steps))
        self.parameters = [param for param in model.parameters() if param.requires_grad]
        self.summed_over_tensor_ranks = summed_over_tensor_ranks(
            model, parallel_state.get_tensor_model_parallel_world_size()
        )
        """As the policy's: parameters each tensor-parallel rank holds whole with a share of the gradient."""
        self.gradients = torch.zeros(sum(param.numel() for param in self.parameters), device=self.parameters[0].device)
        view_gradients(self.parameters, self.gradients)

    def move_gradients(self, where: torch.device) -> None:
        self.gradients = self.gradients.to(where)
        view_gradients(self.parameters, self.gradients)

    def training_state(self, *, on_host: bool) -> TrainingState:
        return TrainingState(self.model, self.local_optimizer, self.scheduler, optimizer_on_host=on_host)

    def heal_state(self) -> dict[str, Any]:
        return trained_state(self.model, self.optimizer, self.scheduler)

    def heal(self, state: dict[str, Any]) -> None:
        load_trained_state(self.model, self.optimizer, self.scheduler, state)

    @torch.no_grad()
    def values(self, micro_batches: list[MicroBatch], shape: torch.Size, device: torch.device) -> torch.Tensor:
        """The value of each token's state, ``shape`` as the rollout's tokens (0 where nothing is scored),
        on every pipeline stage."""
        values = torch.zeros(shape, device=device)

        def score(index: int, hidden: torch.Tensor) -> torch.Tensor:
            mb = micro_batches[index]
            values[mb.cut] = mb.model_input.spread(token_values(self.model, hidden), mb.width)
            return hidden.new_zeros(())

        run_micro_batches(self.model, [mb.model_input for mb in micro_batches], score, backward=False)
        sum_over_stages(values)
        return values

    def shard_loss(
        self,
        micro_batches: list[MicroBatch],
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
        aggregate: Aggregate,
        global_tokens: int,
        *,
        backward: bool,
    ) -> tuple[float, float]:
        """Forward (and backward) of the value loss over ``micro_batches``; returns this shard's (loss, share of
        the step's tokens whose clipped error was the larger), on the last stage (0 elsewhere)."""
        sums = [0.0, 0.0]

        def score(index: int, hidden: torch.Tensor) -> torch.Tensor:
            mb = micro_batches[index]
            cut, m = mb.cut, mask[mb.cut]
            values = mb.model_input.spread(token_values(self.model, hidden), mb.width)
            per_token, clipped = clipped_value_loss(values, old_values[cut], returns[cut], self.settings.value_clip)
            loss = aggregate(per_token, m)
            sums[0] += loss.item()
            sums[1] += reduce_global(clipped, m, global_tokens).item()
            return loss

        run_micro_batches(self.model, [mb.model_input for mb in micro_batches], score, backward)
        return sums[0], sums[1]

    def step(self, clip_grad: float) -> float:
        """Clip the summed gradients and step; returns their norm before clipping."""
        norm = grad_norm(self.parameters)
        torch.nn.utils.clip_grads_with_norm_(self.parameters, clip_grad, norm)
        self.optimizer.step()
        self.scheduler.step()
        return norm.item()
