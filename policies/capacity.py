"""How much of the cluster each job gets: its minimum first, growth toward its maximum after.

Pure. A job's replicas and engines are each a range (`trainer.replicas`, `engines.count`: a number,
or ``{min, max}``). A group the job needs to reach a kind's minimum is *needed*; one beyond it is
*growth*, placed only with the room that every job's needed groups leave.

Who gets free slots, in a controller pass (``Sweep``): first every job's needed groups (a pending
job's whole minimum, a running job's groups below its minimum), jobs in submit order; then every
running job's growth, in submit order; then every job's warm spares, in submit order (a replica does
work, a spare waits for one to fail).

`erl scale` changes a running job's sizes (``rescale``): a number pins an exact count within the
kind's range, MIN:MAX declares a new range (and clears the pin).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum

from policies.placement import Group, GroupKind, index_order


class Sweep(Enum):
    """The passes over the jobs within one controller tick, in this order."""

    NEEDED = "needed"
    GROWTH = "growth"
    SPARES = "spares"


SIZED = {GroupKind.REPLICA: "replicas", GroupKind.ENGINE: "engines"}
"""The ranged kinds, by the name a job's spec, its status and `erl scale` give them."""


def mark_growth(missing: Iterable[Group], held: Iterable[Group], minimums: dict[GroupKind, int]) -> list[Group]:
    """The ``missing`` groups, each marked needed while its kind holds fewer than its minimum (counting
    ``held`` and the needed ones before it, lowest index first) and growth after. Which replica or
    engine is gone does not matter: a job that still holds its minimum of a kind is not degraded. A
    warm spare is never needed: it goes where room is left."""
    count = Counter(group.kind for group in held)
    marked = []
    for group in sorted(missing, key=lambda group: index_order(group.name)):
        if group.kind in SIZED:
            needed = count[group.kind] < minimums.get(group.kind, 0)
            count[group.kind] += needed
            group = replace(group, growth=not needed)
        elif group.kind is GroupKind.SPARE:
            group = replace(group, growth=True)
        marked.append(group)
    return marked


def sweep_of(group: Group) -> Sweep:
    """The sweep that places ``group`` (as ``mark_growth`` marked it)."""
    if group.kind is GroupKind.SPARE:
        return Sweep.SPARES
    return Sweep.GROWTH if group.growth else Sweep.NEEDED


def in_sweep(groups: Iterable[Group], sweep: Sweep) -> list[Group]:
    """The groups a sweep may place."""
    return [group for group in groups if sweep_of(group) is sweep]


@dataclass(frozen=True)
class Size:
    """What a job may hold of a kind: its declared range, and an exact count pinned within it."""

    least: int
    most: int
    pinned: int | None = None

    @property
    def bounds(self) -> tuple[int, int]:
        """The fewest and the most it holds now."""
        return (self.pinned, self.pinned) if self.pinned is not None else (self.least, self.most)

    def __str__(self) -> str:
        low, high = self.bounds
        return str(low) if low == high else f"{low}..{high}"


class OutOfRange(ValueError):
    """`erl scale` asked for a size the job's range does not allow."""


def rescale(size: Size, asked: int | tuple[int, int], ceiling: int | None = None) -> Size:
    """The size after `erl scale` asks for ``asked``: a number, within the declared range, is pinned; a
    (MIN, MAX) range replaces the range, MAX at most ``ceiling`` where the kind has one."""
    if isinstance(asked, tuple):
        least, most = asked
        if not 1 <= least <= most:
            raise OutOfRange(f"{least}:{most} is not a range: give MIN:MAX with 1 <= MIN <= MAX")
        if ceiling is not None and most > ceiling:
            raise OutOfRange(f"{least}:{most} goes above {ceiling}, the most the job was submitted for")
        return Size(least, most)
    if not size.least <= asked <= size.most:
        raise OutOfRange(f"{asked} is outside the job's range {size.least}..{size.most}")
    return Size(size.least, size.most, asked)


def colocated_engines(replicas: Size, per_replica: int) -> Size:
    """Colocated, the engines' size follows the replicas': ``per_replica`` engines share each replica's slots."""
    pinned = None if replicas.pinned is None else replicas.pinned * per_replica
    return Size(replicas.least * per_replica, replicas.most * per_replica, pinned)


def current_sizes(declared: dict[str, tuple[int, int]], recorded: dict[str, list]) -> dict[GroupKind, Size]:
    """Each ranged kind's size: as `erl scale` recorded it in the job's status, else as the spec declares."""
    return {kind: Size(*recorded[name]) if name in recorded else Size(*declared[name]) for kind, name in SIZED.items()}
