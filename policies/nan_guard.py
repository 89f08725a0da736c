"""What the trainers do about a non-finite step.

Pure: what every replica saw in one step in, one response out. Every replica
holds the same inputs (they come from the cross-replica all-reduce), so every
replica reaches the same response without talking further.

- A finite step commits.
- A replica whose shard was non-finite recomputes it first. Finite on the
  rerun: the fault was transient; the step is skipped.
- A shard still non-finite is recomputed on a healthy replica, when one took
  part (``needs_recompute_elsewhere``; Megatron's rerun idea, across replicas).
  Finite there: the device it was computed on is at fault; that replica's
  device is quarantined and the step is redone without it.
- Otherwise the fault is in the data or the model: the step is skipped (redone
  as it was); after ``max_consecutive_skips`` skips in a row the trainers roll
  back to the newest snapshot and quarantine the rollout batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Response(Enum):
    COMMIT = "commit"
    SKIP = "skip"
    QUARANTINE_DEVICE = "quarantine_device"
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class StepHealth:
    """One step as every replica sees it after the all-reduce."""

    participants: frozenset[int]
    """Replica indices that took part."""
    nonfinite: frozenset[int]
    """Replicas whose own loss or gradients were non-finite."""
    reduced_finite: bool
    """Whether the all-reduced gradients and loss were finite."""
    transient: frozenset[int] = frozenset()
    """Replicas whose shard came out finite when they recomputed it."""
    finite_elsewhere: frozenset[int] = frozenset()
    """Replicas whose shard, recomputed on another replica, came out finite."""

    @property
    def persistent(self) -> frozenset[int]:
        return self.nonfinite - self.transient


@dataclass(frozen=True)
class Decision:
    response: Response
    replicas: frozenset[int] = frozenset()
    reason: str = ""


def needs_recompute_elsewhere(health: StepHealth) -> bool:
    """Shards non-finite twice go to a healthy replica: only possible when one took part."""
    return bool(health.persistent) and bool(health.participants - health.nonfinite)


def decide(health: StepHealth, consecutive_skips: int, max_consecutive_skips: int) -> Decision:
    """``consecutive_skips``: non-finite steps skipped in a row before this one."""
    if health.reduced_finite and not health.nonfinite:
        return Decision(Response.COMMIT)
    if health.finite_elsewhere:
        bad = ", ".join(str(r) for r in sorted(health.finite_elsewhere))
        return Decision(
            Response.QUARANTINE_DEVICE,
            health.finite_elsewhere,
            f"replica {bad} produced non-finite values that another replica's recompute of the same shard did not",
        )
    if health.nonfinite and not health.persistent:
        bad = ", ".join(str(r) for r in sorted(health.nonfinite))
        return Decision(
            Response.SKIP, health.nonfinite, f"transient non-finite values on replica {bad} (finite on a rerun)"
        )
    where = (
        f"replicas {', '.join(str(r) for r in sorted(health.nonfinite))}"
        if health.nonfinite
        else "the reduced gradients"
    )
    if consecutive_skips + 1 >= max_consecutive_skips:
        return Decision(
            Response.ROLLBACK,
            health.nonfinite,
            f"non-finite in {where} for {consecutive_skips + 1} steps in a row",
        )
    return Decision(Response.SKIP, health.nonfinite, f"non-finite in {where}")
