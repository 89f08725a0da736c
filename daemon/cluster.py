"""What one controller pass works on: the cluster as erld's mirror has it, and the writes a pass makes for a job.

Shared by the controller (``daemon.controller``), its drain steps (``daemon.draining``), and erld's
``/metrics`` (``daemon.metrics``), which renders the last cluster read. ``ClusterRecords`` keeps the
mirror's records parsed, change by change; each pass gets a ``Cluster`` of its own from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from daemon.plan import proc_spec
from elastic_rl.event_kinds import EventKind
from elastic_rl.store import keys
from elastic_rl.store.devices import assignment_slots, failed_slots, used_slots
from policies.devices import DeviceKind
from policies.placement import Group


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
    placed: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """Node -> job -> its processes there, as the index in etcd has them (``keys.placement``)."""

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


class ClusterRecords:
    """The mirror's records, parsed as each one changes (a ``store.mirror.Listener``): every pass's
    ``Cluster`` is a copy of them, with no parsing of the whole keyspace."""

    def __init__(self) -> None:
        self.statuses: dict[str, dict] = {}
        self.progress: dict[str, dict] = {}
        self.reported: dict[str, dict[str, dict]] = {}
        self.assignments: dict[str, dict[str, dict]] = {}
        self.nodes: dict[str, dict] = {}
        self.ledger: dict[str, dict] = {}
        self.draining: dict[str, dict] = {}
        self.placed: dict[str, dict[str, list[str]]] = {}

    def reset(self, prefix: str, entries: dict[str, Any]) -> None:
        """``prefix``: one of the key layout's prefixes, or one job's (``keys.job``, ``keys.assignments``)
        or one node's placements (``keys.placed_on``)."""
        if prefix.startswith(keys.JOBS):
            for records in (self.statuses, self.progress, self.reported):
                _clear(records, prefix, keys.JOBS)
        elif prefix.startswith(keys.ASSIGN):
            _clear(self.assignments, prefix, keys.ASSIGN)
        elif prefix.startswith(keys.PLACED):
            _clear(self.placed, prefix, keys.PLACED)
        elif prefix == keys.NODES:
            self.nodes.clear()
        elif prefix == keys.LEDGER:
            self.ledger.clear()
        elif prefix == keys.DRAINS:
            self.draining.clear()
        for key, value in entries.items():
            self.changed(prefix, key, value)

    def changed(self, prefix: str, key: str, value: Any | None) -> None:
        if key.startswith(keys.JOBS):
            job_id = keys.job_id_of(key)
            if key == keys.job_status(job_id):
                _set(self.statuses, job_id, value)
            elif key == keys.job_progress(job_id):
                _set(self.progress, job_id, value)
            elif key.startswith(keys.procs(job_id)):
                _set_in(self.reported, job_id, keys.last_part(key), value)
        elif key.startswith(keys.ASSIGN):
            _set_in(self.assignments, keys.job_id_of(key), keys.last_part(key), value)
        elif key.startswith(keys.PLACED):
            node, job_id = key[len(keys.PLACED) :].split("/", 1)
            _set_in(self.placed, node, job_id, value)
        elif key.startswith(keys.NODES):
            _set(self.nodes, key[len(keys.NODES) :], value)
        elif key.startswith(keys.LEDGER):
            _set(self.ledger, key, value)
        elif key.startswith(keys.DRAINS):
            _set(self.draining, key[len(keys.DRAINS) :], value)

    def cluster(self, now: float) -> Cluster:
        """A pass's own copy (the controller updates its cluster as it decides), failed slots as of ``now``."""
        return Cluster(
            dict(self.statuses),
            {job: dict(procs) for job, procs in self.assignments.items()},
            dict(self.nodes),
            {job: dict(procs) for job, procs in self.reported.items()},
            failed_slots(self.ledger, now),
            dict(self.progress),
            dict(self.draining),
            {node: dict(jobs) for node, jobs in self.placed.items()},
        )


def _clear(records: dict[str, Any], prefix: str, layout_prefix: str) -> None:
    """Drop the records under ``prefix``: all of them for the layout's own prefix, else the one group
    (a job, a node) the prefix names."""
    if prefix == layout_prefix:
        records.clear()
    else:
        records.pop(prefix[len(layout_prefix) :].split("/", 1)[0], None)


def _set(records: dict[str, Any], name: str, value: Any | None) -> None:
    if value is None:
        records.pop(name, None)
    else:
        records[name] = value


def _set_in(records: dict[str, dict[str, Any]], group: str, name: str, value: Any | None) -> None:
    """``records[group][name] = value``; a group left empty is dropped, as a read of etcd would not find it."""
    if value is not None:
        records.setdefault(group, {})[name] = value
    elif group in records:
        records[group].pop(name, None)
        if not records[group]:
            del records[group]


@dataclass
class Changes:
    """The writes one pass makes for a job, and the events they are worth."""

    puts: dict[str, Any] = field(default_factory=dict)
    deletes: set[str] = field(default_factory=set)
    events: list[tuple[EventKind, str, dict]] = field(default_factory=list)
    services_handed_over: bool = False
    """The services left a draining node at the orchestrator's commit: the trainers follow them in process."""


def placements(assignments: dict[str, dict[str, dict]]) -> dict[str, dict[str, list[str]]]:
    """Node -> job -> the job's processes assigned there, sorted: what the placement index should hold."""
    index: dict[str, dict[str, list[str]]] = {}
    for job_id, assigned in assignments.items():
        for name, assignment in sorted(assigned.items()):
            index.setdefault(assignment["node"], {}).setdefault(job_id, []).append(name)
    return index


def by_group(assigned: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """A job's assignments (process -> assignment) by the group each process belongs to."""
    groups: dict[str, dict[str, dict]] = {}
    for name, assignment in sorted(assigned.items()):
        groups.setdefault(proc_spec(name).group, {})[name] = assignment
    return groups


def held_slots(groups: dict[str, dict[str, dict]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Group -> (node, the slots its processes hold, in rank order): where a colocated group's host is."""
    held = {}
    for group, members in groups.items():
        ranked = sorted(members.items(), key=lambda item: proc_spec(item[0]).rank)
        slots = tuple(slot for _, assignment in ranked for slot in assignment_slots(assignment))
        if slots:
            held[group] = (node_of(members), slots)
    return held


def colocated_with(lost: dict[str, str], groups: dict[str, dict], wanted: dict[str, Group]) -> dict[str, str]:
    """The held colocated groups whose host is ``lost``, with why: a colocated unit moves together."""
    return {
        group: f"it shares the slots of {wanted[group].host}, which moves ({lost[wanted[group].host]})"
        for group in groups
        if group not in lost and group in wanted and wanted[group].host in lost
    }


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
