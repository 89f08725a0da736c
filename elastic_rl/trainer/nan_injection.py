"""The NaN fault-injection switch: makes a chosen replica's loss NaN at chosen steps.

Set by ``fault_tolerance.inject_nan`` in the spec or by ``ERL_INJECT_NAN``
(the same fields as JSON). When neither is set the trainer holds no injector
and its step never looks at one.
"""

from __future__ import annotations

import os
from collections import Counter

from elastic_rl.config import JobSpec, NanInjection

ENV_VAR = "ERL_INJECT_NAN"


class NanInjector:
    def __init__(self, injection: NanInjection, replica: int):
        self.steps = set(injection.steps) if injection.replica in (None, replica) else set()
        self.attempts = injection.attempts
        self.tries: Counter[int] = Counter()

    def poison(self, step: int) -> bool:
        """Whether this try of optimizer step ``step`` must produce NaN."""
        if step not in self.steps:
            return False
        self.tries[step] += 1
        return self.attempts == 0 or self.tries[step] <= self.attempts


def injector_for(spec: JobSpec, replica: int) -> NanInjector | None:
    raw = os.environ.get(ENV_VAR)
    injection = NanInjection.model_validate_json(raw) if raw else spec.fault_tolerance.inject_nan
    return NanInjector(injection, replica) if injection is not None else None
