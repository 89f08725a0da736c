"""The controller: the leader erld's decisions about where every job process runs.

Each pass it reads the cluster as erld's watched copy of etcd has it (jobs,
assignments, live nodes, the device ledger, what the agents report) and
writes assignments, one per process: node, the node's advertise host, device
slot, port, generation.

- A pending job is placed whole (``policies.placement``), or waits with the
  reason in its status.
- A running job's groups are placed again when their node died (its lease ran
  out), a device of theirs failed, or a trainer replica was displaced (its
  device quarantined, or a warm spare waits to take its place). A replica's
  place goes to an idle warm spare first; otherwise a group goes to free
  slots, and where none are free the job runs on without it until some are.
- Replicas and engines may be ranges (`{min, max}`, ``policies.capacity``): a
  pending job starts once its minimum fits; each pass first places every
  job's needed groups, then grows running jobs toward their maximum with the
  slots left, then places warm spares with what is left, jobs in submit
  order each time. A group beyond the minimum that loses its place without
  room elsewhere leaves the job (``replica_removed``) instead of degrading
  it, and comes back where room frees.
- Replica and engine sizes follow `erl scale` (a count pinned within the range, or a new range).
- When the services (lighthouse, router, orchestrator) move, every trainer
  group gets a new generation: their addresses changed. Not when they leave
  a draining node: the trainers follow the new lighthouse in process.
- A draining node (`erl drain`, ``policies.drain``) gets no new process; each
  group there is asked to leave at its safe point (its assignments marked
  ``drain``, same generation), placed elsewhere once it has left, and taken
  as from a dead node if the deadline comes first (``daemon.draining``). The
  services move once the orchestrator has committed and gone; the new
  lighthouse's assignment says which node's lighthouse it relieves and from
  which weights version on, and no trainer group is placed until the
  trainers have published it (they switch lighthouses at that rollout).
- A job without room for its minimum (of replicas or engines, or for its
  services) for longer than `fault_tolerance.below_min_grace_s` pauses: it
  stops as `erl stop` stops it (pausing), then is paused; it goes back to
  pending, and so resumes from its snapshot, once its minimum fits again.
- A stopping job becomes stopped, a pausing one paused, once none of its
  processes runs; a finished job's assignments are removed.
- After the jobs, the placement index (``keys.placement``: node -> job -> its
  processes there) is brought in line with the assignments, so an agent can
  follow only the jobs on its node; the index is rebuilt from the assignments
  every pass, so a write the index missed (a job deleted by `erl submit`
  reusing its name, a leader that died between the two) is mended.

A changed assignment gets the job's next generation, and every write is one
etcd transaction conditional on the leader key being the one this controller
won: a deposed leader's late writes fail (fencing).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoints import layout
from daemon.cluster import Changes, Cluster, by_group, colocated_with, held_slots, node_of, placements, reports
from daemon.draining import drain_groups, relieved_lighthouse_in_use
from daemon.plan import SERVICES, engine_group, group_procs, job_groups, replica_group
from elastic_rl import jobenv
from elastic_rl.event_kinds import EventKind
from elastic_rl.events import EventLog
from elastic_rl.net import free_port
from elastic_rl.spec.job import JobSpec
from elastic_rl.store import keys
from elastic_rl.store.client import Store
from elastic_rl.store.devices import assignment_slots
from elastic_rl.store.job_phase import TERMINAL_PHASES, JobPhase
from policies.capacity import SIZED, Size, Sweep, colocated_engines, current_sizes, in_sweep, mark_growth
from policies.placement import TRAINER_KINDS, Group, GroupKind, place_groups

log = logging.getLogger("erld.controller")


class NotLeader(Exception):
    """The leader key changed under this controller: it stops deciding."""


class Controller:
    def __init__(
        self,
        store: Store,
        node: str,
        events_for: Callable[[str, Path], EventLog],
        committed: Callable[[dict[str, Any], tuple[str, ...], int], None] = lambda puts, deletes, revision: None,
    ):
        """``committed``: told of every write this controller made, with its revision (erld's mirror
        applies it at once, so the next pass sees it whether or not the watch has brought it)."""
        self.store = store
        self.committed = committed
        self.node = node
        self.events_for = events_for
        self.leader_revision = 0

    async def _commit(self, puts: dict[str, Any], deletes: set[str] | tuple[str, ...] = ()) -> None:
        deletes = tuple(sorted(deletes))
        revision = await self.store.commit_if(keys.LEADER, self.leader_revision, puts, deletes)
        if revision is None:
            raise NotLeader(f"{self.node} is no longer the leader")
        self.committed(puts, deletes, revision)

    async def tick(self, cluster: Cluster) -> None:
        in_order = sorted(cluster.statuses, key=lambda job_id: cluster.statuses[job_id].get("submitted", 0))
        for sweep in Sweep:
            for job_id in in_order:
                await self._decide(job_id, cluster, sweep)

    async def index_placements(self, cluster: Cluster) -> None:
        """Write the placement index as ``cluster``'s assignments have it (a pass's cluster read after
        ``tick``'s writes, so that they are in it)."""

        def by_key(index: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
            return {keys.placement(node, job): names for node, jobs in index.items() for job, names in jobs.items()}

        wanted, held = by_key(placements(cluster.assignments)), by_key(cluster.placed)
        puts = {key: names for key, names in wanted.items() if held.get(key) != names}
        deletes = held.keys() - wanted.keys()
        if puts or deletes:
            await self._commit(puts, deletes)

    async def _decide(self, job_id: str, cluster: Cluster, sweep: Sweep) -> None:
        status = cluster.statuses[job_id]
        phase = status.get("phase")
        if phase == JobPhase.RUNNING:
            await self._keep_placed(job_id, status, cluster, sweep)
        elif sweep is Sweep.NEEDED:
            assigned = cluster.assignments.get(job_id, {})
            reported = cluster.reported.get(job_id, {})
            quiet = not any(r.get("state") == "running" for r in reported.values())
            if phase == JobPhase.PENDING:
                await self._place_new(job_id, status, cluster)
            elif phase == JobPhase.STOPPING and quiet:
                stopped = {**status, "phase": JobPhase.STOPPED, "reason": "stopped by request", "ended": time.time()}
                await self._commit({keys.job_status(job_id): stopped}, {keys.assignment(job_id, n) for n in assigned})
                await self.events_for(job_id, Path(status["workdir"])).emit(EventKind.JOB_STOPPED, "stopped by request")
            elif phase == JobPhase.PAUSING and quiet:
                paused = {**status, "phase": JobPhase.PAUSED}
                await self._commit({keys.job_status(job_id): paused}, {keys.assignment(job_id, n) for n in assigned})
                cluster.statuses[job_id], cluster.assignments[job_id] = paused, {}
                await self.events_for(job_id, Path(status["workdir"])).emit(EventKind.JOB_PAUSED, status["reason"])
            elif phase == JobPhase.PAUSED:
                await self._resume_when_it_fits(job_id, status, cluster)
            elif phase in TERMINAL_PHASES and assigned:
                await self._commit({}, {keys.assignment(job_id, n) for n in assigned})

    async def _spec(self, job_id: str) -> JobSpec:
        return JobSpec.model_validate(await self.store.get(keys.job_spec(job_id)))

    @staticmethod
    def _sizes(spec: JobSpec, status: dict) -> dict[GroupKind, Size]:
        sizes = current_sizes(spec.declared_sizes, status.get("sizes", {}))
        if spec.colocated:  # `erl scale --replicas` takes their engines along
            sizes[GroupKind.ENGINE] = colocated_engines(sizes[GroupKind.REPLICA], spec.engines_per_replica)
        return sizes

    def _wanted(self, spec: JobSpec, status: dict) -> dict[str, Group]:
        """The job's groups at their most: as many replicas and engines as their sizes allow now."""
        sizes = self._sizes(spec, status)
        groups = [g for g in job_groups(spec) if g.kind not in SIZED]
        groups += [replica_group(spec, k) for k in range(sizes[GroupKind.REPLICA].bounds[1])]
        groups += [engine_group(spec, i) for i in range(sizes[GroupKind.ENGINE].bounds[1])]
        return {g.name: g for g in groups}

    def _minimum(self, spec: JobSpec, status: dict) -> list[Group]:
        """The groups a job starts with: its services and the fewest replicas and engines (its warm spares
        come after every job's growth)."""
        marked = mark_growth(self._wanted(spec, status).values(), (), self._minimums(spec, status))
        return in_sweep(marked, Sweep.NEEDED)

    def _minimums(self, spec: JobSpec, status: dict) -> dict[GroupKind, int]:
        """The fewest replicas and engines the job runs with now."""
        return {kind: size.bounds[0] for kind, size in self._sizes(spec, status).items()}

    @staticmethod
    def _assign(group: Group, node: str, devices: tuple[int, ...], nodes: dict, generation: int) -> dict[str, dict]:
        """Process name -> assignment for a placed group. Servers get a port chosen here. A trainer
        rank holds one slot; an engine holds the group's slots (``devices`` when more than one)."""
        made = {}
        for rank, proc in enumerate(group_procs(group)):
            assignment = {
                "node": node,
                "host": nodes[node]["advertise_host"],
                "device": devices[rank] if group.slots else None,
                "generation": generation,
            }
            engine = group.kind in (GroupKind.ENGINE, GroupKind.TEACHER)
            if engine and group.slots > 1:
                assignment["devices"] = list(devices)
            if proc.name in ("lighthouse", "router") or engine:
                assignment["port"] = free_port()
            if proc.name == "router":
                assignment["metrics_port"] = free_port()
            made[proc.name] = assignment
        return made

    async def _place_new(self, job_id: str, status: dict, cluster: Cluster) -> None:
        """Start a pending job with its needed groups; its growth comes in the same pass's growth sweep."""
        spec = await self._spec(job_id)
        wanted = {g.name: g for g in self._minimum(spec, status)}
        placement = place_groups(list(wanted.values()), cluster.free(), kinds=cluster.kinds())
        if not placement.complete:
            if status.get("reason") != placement.reason:
                await self._commit({keys.job_status(job_id): {**status, "reason": placement.reason}})
            return
        workdir = Path(status["workdir"])
        workdir.mkdir(parents=True, exist_ok=True)
        jobenv.write_spec(workdir, spec)
        generation = status.get("generation", 0) + 1
        made: dict[str, dict] = {}
        for name, (node, devices) in placement.assigned.items():
            made.update(self._assign(wanted[name], node, devices, cluster.nodes, generation))
        for assignment in made.values():
            assignment["initial"] = True  # what the job starts with: no news when it comes up
        running = {**status, "phase": JobPhase.RUNNING, "reason": "", "generation": generation, "unplaced": []}
        await self._commit(
            {keys.job_status(job_id): running, **{keys.assignment(job_id, n): a for n, a in made.items()}}
        )
        cluster.statuses[job_id], cluster.assignments[job_id] = running, made
        where = sorted({a["node"] for a in made.values()})
        await self.events_for(job_id, workdir).emit(
            EventKind.JOB_STARTED, f"{len(made)} processes on node(s) {', '.join(where)}", nodes=where
        )

    async def _resume_when_it_fits(self, job_id: str, status: dict, cluster: Cluster) -> None:
        """A paused job whose minimum fits in the free slots goes back to pending: placed at the next pass,
        its processes resume from the newest snapshot."""
        spec = await self._spec(job_id)
        if not place_groups(self._minimum(spec, status), cluster.free(), kinds=cluster.kinds()).complete:
            return
        queued = {**status, "phase": JobPhase.PENDING, "reason": "", "resumed": time.time(), "degraded": []}
        queued.pop("below_min_since", None)
        await self._commit({keys.job_status(job_id): queued})
        cluster.statuses[job_id] = queued
        await self.events_for(job_id, Path(status["workdir"])).emit(
            EventKind.JOB_RESUMED, "room for its minimum again: it resumes from its newest snapshot"
        )

    async def _keep_placed(self, job_id: str, status: dict, cluster: Cluster, sweep: Sweep) -> None:
        """The needed sweep moves and replaces what lost its place; the growth sweep adds what the job's
        ranges allow where slots are free."""
        spec = await self._spec(job_id)
        wanted = self._wanted(spec, status)
        groups = by_group(cluster.assignments.get(job_id, {}))
        reported = cluster.reported.get(job_id, {})
        generation = status.get("generation", 0) + 1
        changes = Changes()

        lost = {}
        if sweep is Sweep.NEEDED:
            lost = self._lost_groups(groups, wanted, reported, cluster)
            lost.update(colocated_with(lost, groups, wanted))
            drained = drain_groups(job_id, groups, lost, reported, cluster, changes)
            lost.update(drained)
        for group in lost:
            changes.deletes |= {keys.assignment(job_id, n) for n in groups[group]}
            if lost[group] == "scaled away" and group.startswith("replica-"):
                changes.events.append((EventKind.REPLICA_REMOVED, f"{group} leaves (`erl scale`)", {"group": group}))
        kept = {g: m for g, m in groups.items() if g not in lost}
        services_restart = SERVICES in lost and not changes.services_handed_over
        # When the services move every trainer restarts anyway: no spare is worth promoting then.
        promoted = (
            set()
            if services_restart or sweep is not Sweep.NEEDED
            else self._promote_spares(job_id, lost, kept, groups, reported, generation, changes)
        )
        placed, degraded = self._place_missing(
            job_id, spec, status, wanted, kept, lost, cluster, generation, changes, sweep
        )
        if SERVICES in placed and changes.services_handed_over:
            # The trainers may still be training what the old orchestrator committed: the old lighthouse's agent
            # keeps it until they have published the weights after its last rollout, as this one says.
            committed = layout.committed_rollouts(Path(status["workdir"]))
            relieves = {"node": node_of(groups[SERVICES]), "until": layout.version_after(max(committed, default=-1))}
            key = keys.assignment(job_id, "lighthouse")
            changes.puts[key] = {**changes.puts[key], "relieves": relieves}
        if SERVICES in placed and services_restart:
            # Every trainer group restarts with the services' new addresses.
            for group, members in kept.items():
                if group.startswith(("replica-", "spare-")) and group not in promoted:
                    for proc, assignment in members.items():
                        changes.puts[keys.assignment(job_id, proc)] = {**assignment, "generation": generation}
        engines = sum(1 for g in wanted if g.startswith("engine-"))
        before = status.get("engines_placed", spec.engine_count)
        if engines != before:
            changes.events.append((EventKind.ENGINES_SCALED, f"{before} -> {engines} engines", {"engines": engines}))
        held = Counter(wanted[g].kind for g in set(kept) | placed if g in wanted)
        sizes = self._sizes(spec, status)
        new_status = {
            **status,
            "engines_placed": engines,
            "size": {name: [held[kind], *sizes[kind].bounds] for kind, name in SIZED.items()},
        }
        if sweep is Sweep.NEEDED:
            new_status["unplaced"] = sorted(degraded)
            self._below_minimum(spec, new_status, {g for g in degraded if wanted[g].kind is not GroupKind.SPARE})
        if changes.puts or changes.deletes:
            new_status["generation"] = generation
        elif new_status == status:
            return
        changes.puts[keys.job_status(job_id)] = new_status
        await self._commit(changes.puts, changes.deletes)
        # What this pass decided is what the next sweep, and the next job, see.
        prefix = keys.assignments(job_id)
        assigned = {
            name: a for name, a in cluster.assignments.get(job_id, {}).items() if prefix + name not in changes.deletes
        }
        assigned.update({key[len(prefix) :]: a for key, a in changes.puts.items() if key.startswith(prefix)})
        cluster.assignments[job_id], cluster.statuses[job_id] = assigned, new_status
        events = self.events_for(job_id, Path(status["workdir"]))
        for kind, message, fields in changes.events:
            await events.emit(kind, message, **fields)

    @staticmethod
    def _below_minimum(spec: JobSpec, status: dict, short: set[str]) -> None:
        """Note in ``status`` since when the job has lacked room for its minimum (``short``: the needed
        groups without room; a warm spare is not needed to make progress), and set it pausing once
        that lasted longer than its grace."""
        if not short:
            status.pop("below_min_since", None)
            return
        since = status.setdefault("below_min_since", time.time())
        grace = spec.fault_tolerance.below_min_grace_s
        if time.time() - since > grace:
            status["phase"] = JobPhase.PAUSING
            status["reason"] = f"no room for {', '.join(sorted(short))} for {grace:g} s: paused until there is"

    @staticmethod
    def _lost_groups(groups: dict, wanted: dict, reported: dict, cluster: Cluster) -> dict[str, str]:
        """Groups that must leave where they are, with why."""
        lost = {}
        for group, members in groups.items():
            node = node_of(members)
            if group not in wanted:
                lost[group] = "scaled away"
            elif node not in cluster.nodes:
                lost[group] = f"node {node} is gone"
            elif any(set(assignment_slots(a)) & cluster.failed.get(node, set()) for a in members.values()):
                lost[group] = f"a device of it on node {node} failed"
            elif any(reports(reported, n, a, "displaced") for n, a in members.items()):
                lost[group] = "displaced from its devices"
        return lost

    @staticmethod
    def _promote_spares(job_id, lost, kept, groups, reported, generation, changes: Changes) -> set[str]:
        """A lost replica's place goes to an idle warm spare: its processes keep running, renamed."""
        adopted = {a.get("adopt") for members in groups.values() for a in members.values()}
        idle = [
            g
            for g, members in kept.items()
            if g.startswith("spare-")
            and all(reports(reported, n, a, "running") and n not in adopted for n, a in members.items())
        ]
        promoted = set()
        for group in sorted(g for g in lost if g.startswith("replica-") and lost[g] != "scaled away"):
            if not idle:
                break
            spare = idle.pop(0)
            spare_members = kept.pop(spare)
            for proc, (spare_proc, spare_assignment) in zip(sorted(groups[group]), sorted(spare_members.items())):
                taken = {**spare_assignment, "generation": generation, "adopt": spare_proc}
                changes.puts[keys.assignment(job_id, proc)] = taken
                changes.deletes.discard(keys.assignment(job_id, proc))
                changes.deletes.add(keys.assignment(job_id, spare_proc))
                kept.setdefault(group, {})[proc] = taken
            promoted.add(group)
            changes.events.append(
                (
                    EventKind.SPARE_PROMOTED,
                    f"{spare} takes the place of {group} ({lost[group]})",
                    {"proc": sorted(groups[group])[0]},
                )
            )
        return promoted

    def _place_missing(
        self, job_id, spec, status, wanted, kept, lost, cluster: Cluster, generation, changes: Changes, sweep: Sweep
    ) -> tuple[set[str], set[str]]:
        """Place the wanted groups without a place that ``sweep`` may place: in the needed sweep the lost,
        promoted spares' and new engines' groups up to each kind's minimum, in the growth sweep the rest
        of the replicas and engines, in the spares sweep the warm spares; return the groups placed and
        the needed ones still without room."""
        held_groups = [wanted[g] for g in kept if g in wanted]
        missing = [wanted[g] for g in wanted if g not in kept]
        marked = mark_growth(missing, held_groups, self._minimums(spec, status))
        if sweep is Sweep.NEEDED:
            for group in marked:
                if group.growth and group.name in lost and group.kind in SIZED:
                    count = sum(1 for g in held_groups if g.kind is group.kind)
                    changes.events.append(
                        (
                            EventKind(f"{group.kind.value}_removed"),
                            f"{group.name} leaves ({lost[group.name]}): the job goes on with {count}; it grows back "
                            "where slots come free",
                            {"group": group.name},
                        )
                    )
        missing = in_sweep(marked, sweep)
        relieves = kept.get(SERVICES, {}).get("lighthouse", {}).get("relieves")
        if changes.services_handed_over or relieved_lighthouse_in_use(Path(status["workdir"]), relieves):
            # A trainer started now would ask the new lighthouse for a quorum while the others still train
            # on the old one: it starts once they have switched.
            missing = [group for group in missing if group.kind not in TRAINER_KINDS]
        if not missing:
            return set(), set()
        held = {n: a for members in kept.values() for n, a in members.items()}
        others = {**cluster.assignments, job_id: held}
        free = Cluster(cluster.statuses, others, cluster.nodes, {}, cluster.failed, draining=cluster.draining).free()
        existing = {g: (wanted[g].kind, node_of(m)) for g, m in kept.items() if g in wanted}
        placement = place_groups(missing, free, existing, cluster.kinds(), held_slots(kept))
        for group, (node, devices) in placement.assigned.items():
            made = self._assign(wanted[group], node, devices, cluster.nodes, generation)
            for proc, assignment in made.items():
                changes.puts[keys.assignment(job_id, proc)] = assignment
                changes.deletes.discard(keys.assignment(job_id, proc))
            kind = wanted[group].kind.value
            if sweep is not Sweep.NEEDED:
                changes.events.append(
                    (EventKind(f"{kind}_added"), f"{group} joins on node {node}", {"group": group, "node": node})
                )
            elif group in lost:
                changes.events.append(
                    (EventKind(f"{kind}_moved"), f"{group} moves to node {node} ({lost[group]})", {"node": node})
                )
        degraded = set(placement.unplaced)
        for group in degraded - set(status.get("unplaced", [])):
            kind = wanted[group].kind.value
            changes.events.append(
                (
                    EventKind(f"{kind}_degraded"),
                    f"{group} waits for room ({placement.reason}); the job runs on without it",
                    {},
                )
            )
        return set(placement.assigned), degraded
