"""How much of the cluster each job gets: its minimum first, growth toward its maximum after.

Pure. A job's replicas and engines are each a range (`trainer.replicas`, `engines.count`: a number,
or ``{min, max}``). A group the job needs to reach a kind's minimum is *needed*; one beyond it is
*growth*, placed only with the room that every job's needed groups leave.

Who gets free slots, in a controller pass (``Sweep``): first every job's needed groups (a pending
job's whole minimum, a running job's groups below its minimum), jobs in submit order; then every
running job's growth, in submit order. Warm spares count as needed: the spec asks for them by number.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from enum import Enum

from policies.placement import Group, GroupKind, index_order


class Sweep(Enum):
    """The passes over the jobs within one controller tick, in this order."""

    NEEDED = "needed"
    GROWTH = "growth"


RANGED_KINDS = (GroupKind.REPLICA, GroupKind.ENGINE)


def mark_growth(missing: Iterable[Group], held: Iterable[Group], minimums: dict[GroupKind, int]) -> list[Group]:
    """The ``missing`` groups, each marked needed while its kind holds fewer than its minimum (counting
    ``held`` and the needed ones before it, lowest index first) and growth after. Which replica or
    engine is gone does not matter: a job that still holds its minimum of a kind is not degraded."""
    count = Counter(group.kind for group in held)
    marked = []
    for group in sorted(missing, key=lambda group: index_order(group.name)):
        if group.kind in RANGED_KINDS:
            needed = count[group.kind] < minimums.get(group.kind, 0)
            count[group.kind] += needed
            group = replace(group, growth=not needed)
        marked.append(group)
    return marked


def in_sweep(groups: Iterable[Group], sweep: Sweep) -> list[Group]:
    """The groups a sweep may place."""
    return [group for group in groups if group.growth == (sweep is Sweep.GROWTH)]
