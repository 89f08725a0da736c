"""A size that may vary while a job runs: `trainer.replicas` and `engines.count`.

Written as a number N (the job has exactly N) or as ``{min: A, max: B}``: the job starts once A fit,
grows toward B whenever slots are free, and goes on with fewer than B (never fewer than A) when
capacity goes.
"""

from __future__ import annotations

from typing import Any

from pydantic import PositiveInt, SerializerFunctionWrapHandler, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from elastic_rl.spec.base import Component


class SizeRange(Component):
    """At least ``min``, at most ``max``; a plain number N means min = max = N."""

    min: PositiveInt
    """The job waits (pending) until this many are placed."""
    max: PositiveInt
    """The job grows to this many where slots are free."""

    @model_validator(mode="before")
    @classmethod
    def _a_number_is_a_fixed_size(cls, data: Any) -> Any:
        if isinstance(data, int) and not isinstance(data, bool):
            if data < 1:  # as a plain PositiveInt field says it, not once for min and once for max
                raise PydanticCustomError("greater_than", "Input should be greater than 0", {"gt": 0})
            return {"min": data, "max": data}
        return data

    @model_validator(mode="after")
    def _min_not_above_max(self) -> SizeRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max}); give min <= max, or one number")
        return self

    @model_serializer(mode="wrap")
    def _fixed_as_a_number(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Written back as it is read: a fixed size stays a number in `erl validate` and the spec's hash.
        return self.min if self.fixed else handler(self)

    @property
    def fixed(self) -> bool:
        return self.min == self.max


def declared_sizes(
    replicas: SizeRange, engines: SizeRange, rollout_only: bool, train_only: bool
) -> dict[str, tuple[int, int]]:
    """(fewest, most) replicas and engines a job declares: none of a kind its debug mode does not run."""
    return {
        "replicas": (0, 0) if rollout_only else (replicas.min, replicas.max),
        "engines": (0, 0) if train_only else (engines.min, engines.max),
    }
