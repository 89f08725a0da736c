"""The trainer's AdamW: whole on every rank, or its state sharded across the replica's data-parallel ranks;
with bf16 parameters, megatron's distributed optimizer.

Sharded (``trainer.shard_optimizer`` with ``trainer.data_parallel`` > 1) it is torch's
``ZeroRedundancyOptimizer`` over megatron's data-parallel group: each rank owns some of the parameters
(whole tensors, balanced by size), keeps AdamW's moments for those alone, updates them and broadcasts
them to the other ranks. Its own state dict gathers everything onto one rank, which neither a snapshot
nor a heal wants: both take the *local* optimizer (``local_optimizer``), whose state holds this rank's
parameters only, keyed by the parameter. A snapshot saves each moment under its parameter's name, so
it loads at another data-parallel size; a heal goes rank to rank between replicas of one layout.

With ``trainer.optimizer_offload`` the AdamW (whole, or each rank's share) is ``HostAdamW``: its moments,
and its update, in host memory.

With ``trainer.dtype: bf16-params`` (GPU slots) it is megatron's DistributedOptimizer instead
(``trainer.master_weights``), which refuses CPU tensors: it holds the fp32 main weights, and its moments
are always sharded over the data-parallel ranks.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from torch.distributed.optim import ZeroRedundancyOptimizer

from elastic_rl.spec.trainer import TrainerSpec
from elastic_rl.trainer.host_adamw import HostAdamW
from elastic_rl.trainer.master_weights import MasterWeights
from policies.devices import Precision


def build_optimizer(model: torch.nn.Module, trainer: TrainerSpec) -> torch.optim.Optimizer | MasterWeights:
    """The optimizer of ``model``'s trained parameters, this rank's part of the replica, freshly built (in
    bf16-params this casts the model to bf16)."""
    if trainer.dtype is Precision.BF16_PARAMS:
        return MasterWeights(model, trainer)
    settings = {
        "lr": trainer.lr,
        "betas": (trainer.adam_beta1, trainer.adam_beta2),
        "weight_decay": trainer.weight_decay,
        # torch's fused kernel (CPU and CUDA): on SmolLM2 a step of 0.09 s against the loop's 0.44 s here.
        "fused": True,
    }
    adamw = HostAdamW if trainer.optimizer_offload else torch.optim.AdamW
    trained = [param for param in model.parameters() if param.requires_grad]
    if trainer.data_parallel > 1 and trainer.shard_optimizer:
        return ZeroRedundancyOptimizer(
            trained,
            optimizer_class=adamw,
            process_group=parallel_state.get_data_parallel_group(),
            **settings,
        )
    return adamw(trained, **settings)


def local_optimizer(optimizer: torch.optim.Optimizer | MasterWeights) -> torch.optim.Optimizer | MasterWeights:
    """The optimizer whose ``state_dict`` holds this rank's part: itself, unless ZeRO shards it."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def scheduled(optimizer: torch.optim.Optimizer | MasterWeights) -> torch.optim.Optimizer:
    """The torch optimizer whose learning rates the schedule sets."""
    return optimizer.optimizer if isinstance(optimizer, MasterWeights) else optimizer


def main_weights(optimizer: torch.optim.Optimizer | MasterWeights) -> MasterWeights | None:
    """What holds the fp32 weights of a bf16 model, which snapshots save in its place; None in fp32."""
    return optimizer if isinstance(optimizer, MasterWeights) else None


def trained_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | MasterWeights,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict:
    """What a heal carries of one trained model from a peer's rank to the same rank of the healed
    replica: the weights, this rank's optimizer state and the schedule's position."""
    return {
        "model": model.state_dict(),
        "optim": local_optimizer(optimizer).state_dict(),
        "scheduler": scheduler.state_dict(),
    }


def load_trained_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | MasterWeights,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict,
) -> None:
    """Take a peer's ``trained_state`` of the same model."""
    model.load_state_dict(state["model"])
    local_optimizer(optimizer).load_state_dict(state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    take_scheduled_rates(optimizer, scheduler)


def take_scheduled_rates(
    optimizer: torch.optim.Optimizer | MasterWeights, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> None:
    """After a heal loaded the scheduler's position: the learning rates it gives, in the optimizer the
    scheduler drives (a sharded optimizer passes them to its local one at its next step)."""
    for group, rate in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = rate
