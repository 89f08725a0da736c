"""The ``placement`` field: whether trainers and engines have devices of their own or take turns on the same ones."""

from __future__ import annotations

from enum import Enum


class PlacementMode(str, Enum):
    DISAGGREGATED = "disaggregated"
    """Every device slot holds one process: a trainer rank or (a shard of) an engine."""
    COLOCATED = "colocated"
    """A slot holds a trainer rank and the engine shard that shares its device. They take turns:
    the engines release their memory while the trainers train, the trainers offload theirs while
    the engines generate (slime's ``--colocate``). Each replica's slots host
    ``trainer.tensor_parallel / engines.tp_size`` engines, placed with the replica as one unit."""
