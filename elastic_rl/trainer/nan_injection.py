"""NaN fault injection, for the chaos harness: a chosen replica's loss becomes NaN at chosen steps.

    ERL_INJECT_NAN='{"steps": [5], "replica": 1, "attempts": 0, "model": "policy"}'

set in the environment of the erlds that start the trainers (the chaos `nan`
fault does so). ``replica`` null poisons every replica (bad data);
``attempts`` 0 poisons every try of a step (a persistent fault), n the first n;
``model`` ``critic`` poisons PPO's value loss instead of the policy's loss.
Without the variable nothing is installed: the trainer's step has no branch
for it. With it, each shard computation of a chosen step is armed, and a
forward hook on the model (the policy, or the critic) turns its output to NaN
while armed.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from enum import Enum

import orjson

ENV_VAR = "ERL_INJECT_NAN"


class PoisonedModel(str, Enum):
    POLICY = "policy"
    CRITIC = "critic"
    """PPO's critic (``algorithm.critic``): its value loss."""


@dataclass(frozen=True)
class NanFault:
    steps: frozenset[int]
    replica: int | None
    attempts: int
    model: PoisonedModel = PoisonedModel.POLICY

    @classmethod
    def from_environ(cls) -> NanFault | None:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return None
        given = orjson.loads(raw)
        return cls(
            frozenset(given["steps"]),
            given.get("replica"),
            int(given.get("attempts", 0)),
            PoisonedModel(given.get("model", PoisonedModel.POLICY.value)),
        )


class NanInjector:
    def __init__(self, fault: NanFault):
        self.fault = fault
        self.tries: Counter[int] = Counter()
        self.armed = False

    def poison(self, step: int) -> bool:
        """Whether this try of optimizer step ``step`` must produce NaN."""
        if step not in self.fault.steps:
            return False
        self.tries[step] += 1
        return self.fault.attempts == 0 or self.tries[step] <= self.fault.attempts

    def install(self, trainer) -> None:
        compute = trainer._shard_loss

        def shard_loss(*args, **kwargs):
            self.armed = self.poison(trainer.manager.current_step())
            try:
                return compute(*args, **kwargs)
            finally:
                self.armed = False

        trainer._shard_loss = shard_loss
        poisoned = trainer.critic.model if self.fault.model is PoisonedModel.CRITIC else trainer.model
        poisoned.register_forward_hook(lambda module, inputs, output: output * float("nan") if self.armed else None)


def install_from_environment(trainer, replica: int) -> None:
    fault = NanFault.from_environ()
    if fault is not None and fault.replica in (None, replica):
        NanInjector(fault).install(trainer)
