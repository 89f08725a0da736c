"""What one controller pass works on: the cluster as read from etcd, and the writes a pass makes for a job.

Shared by the controller (``daemon.controller``), its drain steps (``daemon.draining``), and erld's
``/metrics`` (``daemon.metrics``), which renders the last cluster read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from daemon.plan import proc_spec
from elastic_rl.store.devices import used_slots
from policies.devices import DeviceKind


@dataclass
class Cluster:
    """What one pass reads from etcd."""

    statuses: dict[str, dict]
    assignments: dict[str, dict[str, dict]]
    nodes: dict[str, dict]
    reported: dict[str, dict[str, dict]]
    """Job -> process -> the record its agent reports."""
    failed: dict[str, set[int]]
    progress: dict[str, dict] = field(default_factory=dict)
    draining: dict[str, dict] = field(default_factory=dict)
    """Node -> its drain record (``elastic_rl.store.drains``)."""

    def free(self) -> dict[str, list[int]]:
        """Each live node's free slots; a draining node is left out (not even the services go there)."""
        used = used_slots(self.statuses, self.assignments)
        return {
            node: [i for i in range(info["devices"]) if i not in used.get(node, set()) | self.failed.get(node, set())]
            for node, info in self.nodes.items()
            if node not in self.draining
        }

    def kinds(self) -> dict[str, DeviceKind]:
        """What each live node's slots are (an erld that says nothing has CPU slots)."""
        return {node: DeviceKind(info.get("kind", DeviceKind.CPU.value)) for node, info in self.nodes.items()}


@dataclass
class Changes:
    """The writes one pass makes for a job, and the events they are worth."""

    puts: dict[str, Any] = field(default_factory=dict)
    deletes: set[str] = field(default_factory=set)
    events: list[tuple[str, str, dict]] = field(default_factory=list)
    services_handed_over: bool = False
    """The services left a draining node at the orchestrator's commit: the trainers follow them in process."""


def by_group(assigned: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """A job's assignments (process -> assignment) by the group each process belongs to."""
    groups: dict[str, dict[str, dict]] = {}
    for name, assignment in sorted(assigned.items()):
        groups.setdefault(proc_spec(name).group, {})[name] = assignment
    return groups


def reported_state(reported: dict[str, dict], proc: str, assignment: dict) -> str | None:
    """The state the agent reports ``proc`` in for this very assignment; None before it reports one (a
    predecessor's report does not count)."""
    record = reported.get(proc, {})
    return record.get("state") if record.get("generation") == assignment["generation"] else None


def reports(reported: dict[str, dict], proc: str, assignment: dict, state: str) -> bool:
    """Whether the agent reports ``proc`` in ``state`` for this very assignment."""
    return reported_state(reported, proc, assignment) == state


def node_of(members: dict[str, dict]) -> str:
    """The node a group's processes share."""
    return next(iter(members.values()))["node"]
