"""The ``checkpoints`` section: how often the training state is snapshotted and what is kept."""

from __future__ import annotations

from pydantic import Field, PositiveInt

from elastic_rl.spec.base import Component


class CheckpointSpec(Component):
    """Snapshots of the training state."""

    interval_rollouts: PositiveInt = 1
    """Take a snapshot after every this many rollouts."""
    keep_last: PositiveInt = 3
    """Newest snapshots kept."""
    keep_every: int = Field(0, ge=0)
    """Also keep every snapshot whose step is a multiple of this; 0 keeps none extra."""
    async_save: bool = True
    """Stage the snapshot and write it in the background."""
    keep_weights: int = Field(2, ge=2)
    """Newest exported weight versions kept for the engines; older ones are deleted, except those
    of kept snapshots (engines start on them after `erl resume --snapshot`) and those superseded
    less than engines.startup_timeout_s ago (an engine starting on one may still be loading it)."""
