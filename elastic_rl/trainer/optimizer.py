"""The trainer's AdamW: whole on every rank, or its state sharded across the replica's data-parallel ranks.

Sharded (``trainer.shard_optimizer`` with ``trainer.data_parallel`` > 1) it is torch's
``ZeroRedundancyOptimizer`` over megatron's data-parallel group: each rank owns some of the parameters
(whole tensors, balanced by size), keeps AdamW's moments for those alone, updates them and broadcasts
them to the other ranks. Its own state dict gathers everything onto one rank, which neither a snapshot
nor a heal wants: both take the *local* optimizer (``local_optimizer``), whose state holds this rank's
parameters only, keyed by the parameter. A snapshot saves each moment under its parameter's name, so
it loads at another data-parallel size; a heal goes rank to rank between replicas of one layout.

Megatron's own DistributedOptimizer is not used: it refuses CPU tensors, and this trainer's step loop
is its own (``trainer.grpo``), not megatron's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from megatron.core import parallel_state
from torch.distributed.optim import ZeroRedundancyOptimizer

from elastic_rl.spec.trainer import TrainerSpec


def build_optimizer(parameters: Iterable[torch.nn.Parameter], trainer: TrainerSpec) -> torch.optim.Optimizer:
    settings = {
        "lr": trainer.lr,
        "betas": (trainer.adam_beta1, trainer.adam_beta2),
        "weight_decay": trainer.weight_decay,
        # torch's fused kernel (CPU and CUDA): on SmolLM2 a step of 0.09 s against the loop's 0.44 s here.
        "fused": True,
    }
    if trainer.data_parallel > 1 and trainer.shard_optimizer:
        return ZeroRedundancyOptimizer(
            list(parameters),
            optimizer_class=torch.optim.AdamW,
            process_group=parallel_state.get_data_parallel_group(),
            **settings,
        )
    return torch.optim.AdamW(parameters, **settings)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``state`` and ``state_dict`` hold this rank's part: itself, unless sharded."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def take_scheduled_rates(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """After a heal loaded the scheduler's position: the learning rates it gives, in the optimizer the
    scheduler drives (a sharded optimizer passes them to its local one at its next step)."""
    for group, rate in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = rate
