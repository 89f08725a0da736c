"""Where a job's processes run: which node, which device slots.

Pure: the groups to place, each node's free device slots and where the job's
other groups already are, in; an assignment per group (or the reason none
fits), out. A group is what must share a node: a trainer replica's
tensor-parallel ranks, a warm spare's, one engine, or the job's three services
(lighthouse, router, orchestrator: no device slot).

- Trainer replicas and spares go first, each to the node holding the fewest
  of the job's trainer groups, so one node's death takes the fewest replicas;
  then the node with the most free slots; then the name.
- Engines go to the node holding the fewest of the job's engines, then the
  most free slots, then the name.
- The services go to the node holding the fewest of the job's groups (the
  node least likely to take a replica down with it), then the name.

Failed devices are simply not free. Ties always break the same way, so
placement is deterministic.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum


class GroupKind(Enum):
    REPLICA = "replica"
    SPARE = "spare"
    ENGINE = "engine"
    SERVICES = "services"


TRAINER_KINDS = (GroupKind.REPLICA, GroupKind.SPARE)


@dataclass(frozen=True)
class Group:
    name: str
    """replica-<k>, spare-<s>, engine-<i> or services."""
    kind: GroupKind
    slots: int
    """Device slots it needs: the tensor-parallel size for trainer groups, 1 for an engine, 0 for services."""


@dataclass(frozen=True)
class Placement:
    assigned: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    """Group name -> (node, device slots)."""
    unplaced: tuple[str, ...] = ()
    reason: str = ""

    @property
    def complete(self) -> bool:
        return not self.unplaced


ORDER = {GroupKind.REPLICA: 0, GroupKind.SPARE: 1, GroupKind.ENGINE: 2, GroupKind.SERVICES: 3}


def place_groups(
    groups: list[Group], free: dict[str, list[int]], existing: dict[str, tuple[GroupKind, str]] | None = None
) -> Placement:
    """Place ``groups`` given each live node's free slots and the job's groups already placed
    (``existing``: group name -> (kind, node)). Groups that fit nowhere are left unplaced."""
    free = {node: sorted(slots) for node, slots in free.items()}
    where = dict(existing or {})
    assigned: dict[str, tuple[str, tuple[int, ...]]] = {}
    unplaced = []
    for group in sorted(groups, key=lambda g: (ORDER[g.kind], g.name)):
        fitting = [node for node, slots in free.items() if len(slots) >= group.slots]
        if not fitting:
            unplaced.append(group.name)
            continue
        count = Counter(node for kind, node in where.values() if _same_family(kind, group.kind))
        node = min(fitting, key=lambda n: (count[n], -len(free[n]), n))
        taken, free[node] = tuple(free[node][: group.slots]), free[node][group.slots :]
        assigned[group.name] = (node, taken)
        where[group.name] = (group.kind, node)
    reason = ""
    if unplaced:
        needs = ", ".join(f"{g.name} ({g.slots} slots on one node)" for g in groups if g.name in unplaced)
        have = ", ".join(f"{node}: {len(slots)}" for node, slots in sorted(free.items())) or "no live node"
        reason = f"no node has room for {needs}; free device slots left: {have}"
    return Placement(assigned, tuple(unplaced), reason)


def _same_family(placed: GroupKind, placing: GroupKind) -> bool:
    """Which placed groups a new group spreads away from."""
    if placing in TRAINER_KINDS:
        return placed in TRAINER_KINDS
    if placing is GroupKind.ENGINE:
        return placed is GroupKind.ENGINE
    return True  # the services avoid every group of the job
