"""What erld does with its node's job processes when its node lease may have run out.

A node cannot tell an etcd outage from its own partition: either way its lease refreshes fail. So a
lost lease kills nothing. While etcd does not answer, erld keeps its processes running, fenced: it
starts, stops and restarts nothing, and each process commits nothing it cannot confirm with etcd
(``elastic_rl.fencing``). Once etcd answers:

- the lease is still there (etcd came back within the lease's TTL): carry on;
- the lease is gone: join again under a new lease and settle each process on its own: it keeps
  running where its assignment still names this node at the generation it was started with, and is
  ended where the controller moved its work on meanwhile (a partition: the others' controller saw
  the node go and placed its work elsewhere).

An outage of etcd itself may let every node's lease run out at once. The erld that leads once etcd
answers again must then not take the other nodes' absence for their death before they have had the
time to join again (``may_decide``): it waits one lease TTL after its own fence ends.

Pure: what erld knows of its lease in, an action out; an assignment and a process in, its fate out.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class LeaseStanding(Enum):
    FRESH = "fresh"
    """Renewed within the lease's TTL."""
    UNCONFIRMED = "unconfirmed"
    """A TTL has passed since the last renewal and etcd has not answered since: the lease may be gone."""
    STILL_HELD = "still_held"
    """etcd answers again and the lease was still there."""
    EXPIRED = "expired"
    """etcd answers again and the lease is gone (with the node record and the process records under it)."""


class NodeAction(Enum):
    CARRY_ON = "carry_on"
    FENCE = "fence"
    """Keep every process running; act on nothing (no pass) until etcd answers."""
    REJOIN = "rejoin"
    """Take a new lease and the node name again, keeping the processes; each is then settled by ``fate``."""


class Fate(Enum):
    KEEP = "keep"
    END = "end"


def node_action(standing: LeaseStanding) -> NodeAction:
    if standing is LeaseStanding.UNCONFIRMED:
        return NodeAction.FENCE
    if standing is LeaseStanding.EXPIRED:
        return NodeAction.REJOIN
    return NodeAction.CARRY_ON


def fate(node: str, generation: int, assignment: dict[str, Any] | None) -> Fate:
    """A running process of ``node`` started at ``generation``, against its assignment as etcd holds it
    now (None: removed). Only a process whose assignment moved on (another node, a newer generation, or
    none) is ended: another instance has its place, or is about to."""
    if assignment is not None and assignment["node"] == node and assignment["generation"] == generation:
        return Fate.KEEP
    return Fate.END


def may_decide(since_fenced_s: float | None, lease_ttl_s: float) -> bool:
    """Whether the leading erld's controller may act on the cluster it reads, ``since_fenced_s`` after this
    erld's last fenced pass (None: none). Within one TTL of it, a node missing from the cluster may be one
    whose lease ran out in the same outage and whose erld is about to join again, keeping its processes;
    after it, a missing node is gone (dead, or cut off alone) and its work moves."""
    return since_fenced_s is None or since_fenced_s >= lease_ttl_s
