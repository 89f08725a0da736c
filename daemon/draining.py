"""What the controller does each pass about a job's groups on draining nodes (``policies.drain``).

A draining node's groups are asked to leave at their safe points: their assignments are marked
``drain`` with the node's deadline, at the same generation, so nothing restarts. A group whose processes
all report ``drained`` has left and is placed elsewhere by the controller, as is one still there at the
deadline (as from a dead node). The services leave with the orchestrator, right after its commit: the
new ones start elsewhere while the trainers train what it committed, on the old lighthouse, which the
old node's agent keeps until they are done (the new lighthouse's assignment says whose it relieves);
every trainer then makes its Manager again against the new one at the first rollout the new
orchestrator commits.
"""

from __future__ import annotations

import time
from pathlib import Path

from checkpoints import layout
from daemon.cluster import Changes, Cluster, node_of, reported_state
from daemon.plan import SERVICES
from elastic_rl.event_kinds import EventKind
from elastic_rl.store import keys
from policies.drain import DrainStep, drain_step
from policies.placement import GroupKind


def drain_groups(
    job_id: str,
    groups: dict[str, dict[str, dict]],
    lost: dict[str, str],
    reported: dict[str, dict],
    cluster: Cluster,
    changes: Changes,
) -> dict[str, str]:
    """The groups on draining nodes that have left or run out of time (group -> why); the others there
    are asked to leave (their assignments marked ``drain``). An assignment whose node is no longer
    draining (`erl undrain`) loses its mark."""
    leaving: dict[str, str] = {}
    announced: set[str] = set()
    for group, members in groups.items():
        node = node_of(members)
        drain = cluster.draining.get(node)
        if group in lost:
            continue
        if drain is None:
            for proc, assignment in members.items():
                if "drain" in assignment:
                    changes.puts[keys.assignment(job_id, proc)] = {k: v for k, v in assignment.items() if k != "drain"}
            continue
        states = [reported_state(reported, proc, assignment) for proc, assignment in members.items()]
        if group == SERVICES and "orchestrator" in members:
            # The router and lighthouse leave with the orchestrator. The trainers may still be training what it
            # committed: the old lighthouse stays until they are done (``daemon.agent``).
            states = [states[list(members).index("orchestrator")]]
        step = drain_step(group_kind(group), states, time.time(), drain["deadline"])
        if step is DrainStep.LEFT:
            leaving[group] = f"node {node} drained"
            changes.services_handed_over |= group == SERVICES
        elif step is DrainStep.OVERDUE:
            leaving[group] = f"it had not left node {node} by its drain deadline"
            changes.events.append(
                (
                    EventKind.DRAIN_OVERDUE,
                    f"{group} {leaving[group]}: recovered as after a node death",
                    {"group": group},
                )
            )
        else:
            marked = any("drain" in a for m in groups.values() for a in m.values() if a["node"] == node)
            if not marked and node not in announced:
                announced.add(node)
                changes.events.append(
                    (
                        EventKind.NODE_DRAINING,
                        f"node {node} drains by {time.strftime('%H:%M:%S', time.localtime(drain['deadline']))}",
                        {"node": node, "deadline": drain["deadline"]},
                    )
                )
            for proc, assignment in members.items():
                if assignment.get("drain") != drain["deadline"]:
                    changes.puts[keys.assignment(job_id, proc)] = {**assignment, "drain": drain["deadline"]}
    for node in cluster.draining:
        here = {g for g, m in groups.items() if node_of(m) == node}
        if here and here <= set(leaving) | set(lost) and here & set(leaving):
            changes.events.append((EventKind.NODE_DRAINED, f"the job has left node {node}", {"node": node}))
    return leaving


def group_kind(group: str) -> GroupKind:
    """The kind of a group, by its name."""
    return GroupKind.SERVICES if group == SERVICES else GroupKind(group.rsplit("-", 1)[0])


def relieved_lighthouse_in_use(workdir: Path, relieves: dict | None) -> bool:
    """Whether the trainers still train on the lighthouse that a moved one relieves (its assignment's
    ``relieves``): they have not yet published the weights after the old orchestrator's last rollout."""
    return relieves is not None and (layout.latest_weights_version(workdir) or 0) < relieves["until"]
