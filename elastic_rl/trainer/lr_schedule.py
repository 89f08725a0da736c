"""The learning-rate schedule: the multiplier of the peak learning rate at each optimizer step, the
policy's (``trainer``) or PPO's critic's (``trainer`` with the critic's lr and warmup).

Given to ``LambdaLR``; snapshots and heals carry the scheduler's position, so a
resumed or healed replica continues the same schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from elastic_rl.spec.trainer import TrainerSpec


def lr_lambda(trainer: TrainerSpec, total_steps: int) -> Callable[[int], float]:
    """The multiplier of ``trainer.lr`` at each optimizer step: warmup, then the decay to ``trainer.min_lr``."""
    floor = trainer.min_lr / trainer.lr

    def multiplier(step: int) -> float:
        if trainer.warmup_steps and step < trainer.warmup_steps:
            return (step + 1) / trainer.warmup_steps
        if trainer.lr_decay == "constant":
            return 1.0
        progress = min(1.0, (step - trainer.warmup_steps) / max(1, total_steps - trainer.warmup_steps))
        if trainer.lr_decay == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier
