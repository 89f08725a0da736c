"""Where a job's processes run: which node, which device slots.

Pure: the groups to place, each node's free device slots and where the job's
other groups already are, in; an assignment per group (or the reason none
fits), out. A group is what must share a node: a trainer replica's
tensor-parallel ranks, a warm spare's, one engine (the policy's or a
distillation teacher's), or the job's three services
(lighthouse, router, orchestrator: no device slot).

- Trainer replicas and spares go first, each to the node holding the fewest
  of the job's trainer groups, so one node's death takes the fewest replicas;
  then the node with the most free slots; then the name.
- Engines go to the node holding the fewest of the job's engines, then the
  most free slots, then the name; a distillation teacher's engines likewise,
  spread over the nodes holding the fewest of the teacher's.
- The services go to the node holding the fewest of the job's groups (the
  node least likely to take a replica down with it), then the name.
- A colocated engine takes no free slot: it goes onto slots of its host, the
  replica whose devices it shares, wherever that replica is (placed in the same
  call or before). Without its host placed it has no place either.
- A group that needs CUDA (an SGLang engine, a replica training in bf16) goes
  only to a node whose slots are GPUs; a job's trainer groups all go to nodes
  of one kind, that of the first placed (torchft cannot join a replica on gloo
  with one on NCCL). A node's kind is CPU unless it is said to be CUDA.

A group beyond its job's minimum (a replica or an engine that a `{min, max}` size allows but does
not need) is placed after every needed group, only where room is left; without room it is
`not_grown`, and the placement is still complete.

Failed devices are simply not free. Ties always break the same way, so
placement is deterministic.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from policies.devices import DeviceKind


class GroupKind(Enum):
    REPLICA = "replica"
    SPARE = "spare"
    ENGINE = "engine"
    TEACHER = "teacher"
    SERVICES = "services"


TRAINER_KINDS = (GroupKind.REPLICA, GroupKind.SPARE)


@dataclass(frozen=True)
class Group:
    name: str
    """replica-<k>, spare-<s>, engine-<i>, teacher-<i> or services."""
    kind: GroupKind
    slots: int
    """Device slots it needs: the tensor-parallel size for trainer groups, an engine's tensor-parallel
    size (1 for a cpu engine), 0 for services."""
    cuda_only: bool = False
    """It runs only on GPUs: an SGLang engine, or a replica training in bf16."""
    growth: bool = False
    """Beyond the job's minimum: placed only with the room the needed groups leave."""
    host: str = ""
    """Colocated: the group whose device slots this one shares (an engine's replica); empty otherwise."""
    host_slots: tuple[int, ...] = ()
    """Colocated: which of the host's slots it shares, as positions in the host's slot list."""


@dataclass(frozen=True)
class Placement:
    assigned: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    """Group name -> (node, device slots)."""
    unplaced: tuple[str, ...] = ()
    """Needed groups without room."""
    reason: str = ""
    not_grown: tuple[str, ...] = ()
    """Growth groups without room: the job does without them."""

    @property
    def complete(self) -> bool:
        return not self.unplaced


ORDER = {GroupKind.REPLICA: 0, GroupKind.SPARE: 1, GroupKind.ENGINE: 2, GroupKind.TEACHER: 2, GroupKind.SERVICES: 3}


def place_groups(
    groups: list[Group],
    free: dict[str, list[int]],
    existing: dict[str, tuple[GroupKind, str]] | None = None,
    kinds: dict[str, DeviceKind] | None = None,
    held: dict[str, tuple[str, tuple[int, ...]]] | None = None,
) -> Placement:
    """Place ``groups`` given each live node's free slots, the job's groups already placed
    (``existing``: group name -> (kind, node); ``held``: group name -> (node, slots), which colocated
    groups' hosts need) and the kind of each node's slots (``kinds``; a node not named is CPU).
    Groups that fit nowhere are left unplaced."""
    free = {node: sorted(slots) for node, slots in free.items()}
    where = dict(existing or {})
    kinds = kinds or {}
    assigned: dict[str, tuple[str, tuple[int, ...]]] = {}
    hosts = dict(held or {})
    unplaced, not_grown = [], []
    for group in sorted(groups, key=lambda g: (g.growth, ORDER[g.kind], index_order(g.name))):
        if group.host:
            if group.host not in hosts:
                (not_grown if group.growth else unplaced).append(group.name)
                continue
            node, host_slots = hosts[group.host]
            assigned[group.name] = (node, tuple(host_slots[i] for i in group.host_slots))
            where[group.name] = (group.kind, node)
            continue
        allowed = _allowed_kinds(group, where, kinds)
        fitting = [
            node
            for node, slots in free.items()
            if len(slots) >= group.slots and kinds.get(node, DeviceKind.CPU) in allowed
        ]
        if not fitting:
            (not_grown if group.growth else unplaced).append(group.name)
            continue
        count = Counter(node for kind, node in where.values() if _same_family(kind, group.kind))
        node = min(fitting, key=lambda n: (count[n], -len(free[n]), n))
        taken, free[node] = tuple(free[node][: group.slots]), free[node][group.slots :]
        assigned[group.name] = hosts[group.name] = (node, taken)
        where[group.name] = (group.kind, node)
    reason = ""
    if unplaced:
        needs = ", ".join(f"{g.name} ({_needs(g)})" for g in groups if g.name in unplaced)
        have = ", ".join(f"{node}: {len(slots)}" for node, slots in sorted(free.items())) or "no live node"
        reason = f"no node has room for {needs}; free device slots left: {have}"
    return Placement(assigned, tuple(unplaced), reason, tuple(not_grown))


def _needs(group: Group) -> str:
    if group.host:
        return f"on the slots of {group.host}"
    return f"{group.slots}{' CUDA' if group.cuda_only else ''} slots on one node"


def index_order(name: str) -> tuple[str, int]:
    """replica-2 before replica-10: growth takes the lowest indices first."""
    stem, _, index = name.rpartition("-")
    return (stem, int(index)) if index.isdigit() else (name, 0)


def _allowed_kinds(
    group: Group, where: dict[str, tuple[GroupKind, str]], kinds: dict[str, DeviceKind]
) -> set[DeviceKind]:
    """The kinds of node ``group`` may go to."""
    allowed = {DeviceKind.CUDA} if group.cuda_only else set(DeviceKind)
    if group.kind in TRAINER_KINDS:
        placed = {kinds.get(node, DeviceKind.CPU) for kind, node in where.values() if kind in TRAINER_KINDS}
        if placed:
            allowed &= placed
    return allowed


def _same_family(placed: GroupKind, placing: GroupKind) -> bool:
    """Which placed groups a new group spreads away from."""
    if placing in TRAINER_KINDS:
        return placed in TRAINER_KINDS
    if placing in (GroupKind.ENGINE, GroupKind.TEACHER):
        return placed is placing
    return True  # the services avoid every group of the job
