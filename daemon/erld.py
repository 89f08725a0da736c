"""erld, the node daemon: membership in etcd, the controller when it leads, the agent always.

    erl daemon --node NAME --advertise-host HOST --cpu-devices N --etcd URL[,URL...]
    erl daemon --node NAME --advertise-host HOST --gpus all --etcd URL[,URL...]

Every erld holds its node name under a lease (one live erld per name; an erld
that died on this host is taken over at once). One of them holds the leader
key and is the controller (``daemon.controller``): it places every job's
processes. A node's device slots are CPU slots (``--cpu-devices N``) or its
GPUs (``--gpus all`` or ``--gpus N``, found through NVML, ``daemon.gpus``);
the node record says which, and each process runs on its slots by the device
rule (``policies.devices``). Every erld, the leader too, is an agent (``daemon.agent``): it
runs exactly the processes assigned to its node. A pass reads the cluster from memory: erld
keeps the prefixes it needs, each followed by one etcd watch (``elastic_rl.store.mirror``). The
leader follows the whole cluster; any other erld only the leader key, the device ledger, the drains,
its node's placement index and the jobs that index names (or that still run here), so an erld's work
grows with its node's jobs, not with the cluster. With no ``--etcd`` it starts an embedded etcd
under its state dir.

An erld that cannot renew its lease kills nothing (``policies.lease_loss``): it
cannot tell an etcd outage from its own partition. Once the lease may have run
out (its TTL since the last renewal) it is fenced: it keeps its processes
running and acts on nothing until etcd answers, and each process commits
nothing it cannot confirm with etcd (``elastic_rl.fencing``). If the lease is
gone by then, erld joins again under a new one and keeps each process whose
assignment did not move on; the agents end the others, whose work the
controller placed elsewhere meanwhile.

Under systemd it sends READY=1 once etcd and membership are up, WATCHDOG=1
from a main loop that is making progress, a one-line STATUS=, and STOPPING=1
on SIGTERM, after which it stops its jobs' processes and revokes its lease.
Started with ``--drain-on-term S`` it first drains its own node on SIGTERM (what
Slurm's ``--signal`` or a cloud's preemption watcher sends): the job processes
leave at their safe points and move elsewhere, and erld stops once none is
left here or S seconds have passed.
Each erld serves ``/metrics`` (Prometheus) and ``/healthz`` on its advertise host.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from daemon.agent import JobAgent
from daemon.cluster import Cluster, ClusterRecords
from daemon.controller import Controller, NotLeader
from daemon.metrics import MetricsServer
from daemon.notify import SystemdNotifier, child_environment
from daemon.plan import node_environment
from daemon.pool import InterpreterPool
from daemon.proctable import ProcessTable, ProcState
from elastic_rl.atomic import write_file_atomic
from elastic_rl.errors import InputError
from elastic_rl.event_kinds import EventKind
from elastic_rl.events import EventLog
from elastic_rl.jobs import secret_of
from elastic_rl.net import LOOPBACK
from elastic_rl.spec.job import JobSpec
from elastic_rl.store import keys
from elastic_rl.store.client import LeaseExpired, Store, StoreUnavailable
from elastic_rl.store.drains import start_drain
from elastic_rl.store.embedded import EmbeddedEtcd
from elastic_rl.store.job_phase import ACTIVE_PHASES, TERMINAL_PHASES
from elastic_rl.store.mirror import Mirror
from policies.devices import DeviceKind
from policies.lease_loss import LeaseStanding, NodeAction, may_decide, node_action

log = logging.getLogger("erld")

DEFAULT_LEASE_TTL_S = 10
LOOP_INTERVAL_S = 0.5
EVERY_NODE_FOLLOWS = (keys.LEADER, keys.LEDGER, keys.DRAINS)
"""What every erld keeps in memory, each prefix followed by one watch (``store.mirror``); besides
these, the leader follows ``LEADER_FOLLOWS`` and any other erld its own node's jobs."""
LEADER_FOLLOWS = (keys.JOBS, keys.ASSIGN, keys.NODES, keys.PLACED)


class NodeTaken(InputError):
    """Another live erld holds this node name."""


def erld_alive(pid: int | None) -> bool:
    """Whether ``pid`` is a running erld on this host (a reused pid is not)."""
    try:
        command = psutil.Process(pid).cmdline() if pid else []
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return "daemon" in command and any("erl" in part for part in command)


@dataclass(frozen=True)
class NodeConfig:
    name: str
    advertise_host: str = LOOPBACK
    devices: int = 4
    """Device slots the node offers."""
    device_kind: DeviceKind = DeviceKind.CPU
    """What the slots are: CPU slots, or GPUs."""
    gpu_ids: tuple[str, ...] = ()
    """On a GPU node, what CUDA_VISIBLE_DEVICES names its GPUs by, slot i's at i (``daemon.gpus``)."""
    slot_memory: int | None = None
    """Bytes one slot can hold: a GPU's memory (NVML), or what `--slot-memory` gives a CPU node; None:
    not known, and `erl submit` checks no job against it."""
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S
    device_cooldown_s: float | None = None
    """How long a failed device stays failed; None: until `erl devices reset`."""
    metrics_port: int | None = None
    drain_on_term_s: float | None = None
    """On SIGTERM, drain this node within this many seconds before stopping; None: stop at once."""
    pool_sizes: dict[str, int] = field(default_factory=dict)
    """Idle pre-imported interpreters kept per process kind (``daemon.pool``); none by default here,
    `erl daemon` gives ``daemon.pool.DEFAULT_SIZES``."""


class Erld:
    def __init__(
        self, store: Store, endpoint: str, config: NodeConfig, state_dir: Path, etcd_started_here: bool = False
    ):
        self.store = store
        self.holders_are_dead = etcd_started_here
        """Until the first join: an etcd this erld has just started had no erld connected to it, so a
        node record it holds is a dead erld's (etcd gives restored leases a fresh TTL at restart, so
        the record would look live; its erld may have run on an older version or another hostname)."""
        self.endpoint = endpoint
        self.config = config
        self.node = config.name
        self.state_dir = state_dir
        self.state_file = state_dir / f"procs-{self.node}.json"
        self.saved_state: bytes | None = None
        self.notifier = SystemdNotifier()
        self.table = ProcessTable(self.node, endpoint)
        self.agents: dict[str, JobAgent] = {}
        self.records = ClusterRecords()
        self.followed: tuple[str, ...] = ()
        """What ``follow_what_this_node_needs`` last had the mirror follow, besides ``EVERY_NODE_FOLLOWS``."""
        self.mirror = Mirror(store, (*EVERY_NODE_FOLLOWS, keys.placed_on(self.node)), self.records)
        self.controller = Controller(store, self.node, self._events, self.mirror.applied)
        self.lease = None
        self.renewed = 0.0
        self.rejoining = False
        """The lease was found gone and the node name is not held again yet: fenced until it is."""
        self.last_fenced: float | None = None
        """When a pass last found the node fenced (monotonic); None: never."""
        self.leading = False
        self.stopping = asyncio.Event()
        self.drain_requested: float | None = None
        """When SIGTERM asked this erld to drain its node first (``--drain-on-term``)."""
        self.drain_recorded = False
        self.child_exit = asyncio.Event()
        """Set by SIGCHLD: a process erld started has exited."""
        self.metrics = MetricsServer(self, config.advertise_host, config.metrics_port)
        self.pool = InterpreterPool(self.node, config.pool_sizes, state_dir, node_environment(), endpoint)

    @property
    def devices(self) -> int:
        return self.config.devices

    def _events(self, job_id: str, workdir: Path) -> EventLog:
        return EventLog(self.store, job_id, workdir, self.node)

    # --- membership ---------------------------------------------------------------

    async def join(self) -> None:
        """Hold the node name under a new lease; a live erld holding it already is ``NodeTaken``."""
        self.lease = await self.store.lease(self.config.lease_ttl_s)
        record = {
            "devices": self.config.devices,
            "kind": self.config.device_kind.value,
            "slot_memory": self.config.slot_memory,
            # The machine's memory, shared by its slots: what `erl submit` checks an offloaded optimizer against.
            "host_memory": psutil.virtual_memory().total,
            "started": time.time(),
            "host": socket.gethostname(),
            "advertise_host": self.config.advertise_host,
            "pid": os.getpid(),
            "lease": self.lease.id,
        }
        node_key = keys.node(self.node)
        while not await self.store.create(node_key, record, lease=self.lease):
            holder, revision = await self.store.get_with_revision(node_key)
            if holder is None:
                continue  # its lease ran out just now
            alive = holder.get("host") != record["host"] or (
                holder.get("pid") != os.getpid() and erld_alive(holder.get("pid"))
            )
            if alive and not self.holders_are_dead:
                await self.store.revoke(self.lease)
                raise NodeTaken(
                    f"node name {self.node!r} is held by a live erld (pid {holder.get('pid')} on "
                    f"{holder.get('host')}); one erld runs per node: give this one another --node name, "
                    f"or stop that one (`erl shutdown`, or systemctl stop erld)"
                )
            # The erld that held it died here: take the name over in place, so the node never looks
            # gone to the controller, then drop its lease (its stale process records go with it).
            if await self.store.update_if(node_key, record, revision, lease=self.lease):
                if holder.get("pid") != os.getpid():
                    log.info(
                        "node %s was held by erld pid %s, no longer running: taken over", self.node, holder.get("pid")
                    )
                if holder.get("lease") is not None:
                    await self.store.revoke_lease_id(holder["lease"])
                break
        self.renewed = time.monotonic()
        self.holders_are_dead = False  # from now on, other erlds may connect to this etcd
        for agent in self.agents.values():
            agent.lease, agent.published = self.lease, {}

    async def keep_alive(self) -> None:
        """Refresh the node lease on its own schedule, so a busy main loop never loses membership."""
        while not self.stopping.is_set():
            pause = self.config.lease_ttl_s / 4
            try:
                if self.rejoining:
                    await self.rejoin()
                else:
                    await self.store.refresh(self.lease)
                    self.renewed = time.monotonic()
            except LeaseExpired as exc:  # policies.lease_loss: an expired lease is rejoined, keeping every process
                log.warning("%s", exc)
                self.rejoining = True
                await self.rejoin()
            except StoreUnavailable as exc:
                # etcd may be electing a leader: try again at once, for the lease's time is running out.
                log.warning("lease refresh failed: %s", exc)
                pause = 0.1
            await asyncio.sleep(pause)

    def lease_may_have_expired(self) -> bool:
        return time.monotonic() - self.renewed >= self.config.lease_ttl_s

    def lease_standing(self) -> LeaseStanding:
        """What the main loop knows: fresh, or unconfirmed (the keep-alive learns the rest from etcd)."""
        if self.rejoining or self.lease_may_have_expired():
            return LeaseStanding.UNCONFIRMED
        return LeaseStanding.FRESH

    async def rejoin(self) -> None:
        """The lease is gone: hold the node name under a new one, keeping every process. The agents
        republish their processes under it and end, on their next pass, those whose work moved on."""
        log.warning(
            "node %s lost its lease: joining again; its %d job processes keep running", self.node, len(self.table.procs)
        )
        try:
            await self.join()
        except NodeTaken as taken:
            log.error("%s; stopping its processes and itself", taken)
            self.table.kill_all()
            self.stopping.set()
            return
        except Exception as exc:  # etcd unreachable again, or the new lease gone before the name was taken
            log.warning("rejoining failed (%s); the keep-alive tries again", exc)
            return
        # The controller of this pass must see this node, though the watch may still bring its record's
        # deletion (the old lease's) after this: a node that looked gone would have its work moved.
        node_key = keys.node(self.node)
        record, revision = await self.store.get_with_revision(node_key)
        self.mirror.applied({node_key: record}, (), revision)
        self.rejoining = False

    async def is_leader(self) -> bool:
        """Whether this erld leads, as the mirror has the leader key; with none, try to take it. A stale
        mirror errs safely: every write of the controller is conditional on the key's revision."""
        leader, revision = self.mirror.get_with_revision(keys.LEADER)
        if leader is None:
            if await self.store.create(keys.LEADER, self.node, lease=self.lease):
                log.info("%s is the leader", self.node)
            leader, revision = await self.store.get_with_revision(keys.LEADER)
        self.leading = leader == self.node
        self.controller.leader_revision = revision if self.leading else 0
        return self.leading

    # --- one pass -----------------------------------------------------------------

    async def follow_what_this_node_needs(self, leading: bool) -> None:
        """The leader follows the whole cluster. Any other erld follows its node's placement index, and
        each job it names, runs here still or has an agent here: the job's records and assignments."""
        if leading:
            wanted = LEADER_FOLLOWS
        else:
            jobs = (
                self.records.placed.get(self.node, {}).keys()
                | {job for job, _ in self.table.procs}
                | self.agents.keys()
            )
            wanted = (
                keys.placed_on(self.node),
                *(p for job in sorted(jobs) for p in (keys.job(job), keys.assignments(job))),
            )
        if wanted == self.followed:
            return
        # What is no longer wanted goes first: an erld that stopped leading drops the whole cluster
        # before following its node's part of it (a prefix under one followed is left to that one).
        for prefix in self.mirror.prefixes:
            if prefix not in EVERY_NODE_FOLLOWS and not any(prefix.startswith(kept) for kept in wanted):
                self.mirror.unfollow(prefix)
        for prefix in wanted:
            await self.mirror.follow(prefix)
        self.followed = wanted

    def read_cluster(self) -> Cluster:
        """The cluster as the mirror has it: memory, no etcd request."""
        return self.records.cluster(time.time())

    async def agent_pass(self, cluster: Cluster) -> None:
        local_jobs = {job for job, _ in self.table.procs}
        for job_id, status in cluster.statuses.items():
            assigned = cluster.assignments.get(job_id, {})
            here = any(a["node"] == self.node for a in assigned.values())
            if not here and job_id not in local_jobs:
                self.agents.pop(job_id, None)
                continue
            agent = self.agents.get(job_id)
            # The name was submitted again: what runs here belongs to the earlier job. Or the job was
            # resumed, its processes all gone, maybe with another replica layout (`erl resume --set`):
            # the agent starts again from the spec as it is now.
            if agent is not None and (agent.submitted, agent.resumed) != (
                status.get("submitted"),
                status.get("resumed"),
            ):
                await agent.stop(graceful=False)
                for proc in self.table.of_job(job_id):
                    self.table.forget(proc)
                agent = None
            agent = agent or await self._agent_for(job_id, status)
            await agent.tick(status, assigned, cluster.reported.get(job_id, {}), cluster.failed.get(self.node, set()))
            if status.get("phase") in TERMINAL_PHASES and not here:
                for proc in self.table.of_job(job_id):
                    self.table.forget(proc)
                del self.agents[job_id]

    async def _agent_for(self, job_id: str, status: dict[str, Any]) -> JobAgent:
        spec = JobSpec.model_validate(await self.store.get(keys.job_spec(job_id)))
        workdir = Path(status["workdir"])
        agent = JobAgent(
            job_id,
            spec,
            workdir,
            self.node,
            self.config.advertise_host,
            self.store,
            self.endpoint,
            await secret_of(self.store, job_id),
            self._events(job_id, workdir),
            self.table,
            self.config.device_cooldown_s,
            self.config.device_kind,
            self.config.gpu_ids,
            self.pool,
        )
        agent.lease = self.lease
        agent.submitted, agent.resumed = status.get("submitted"), status.get("resumed")
        self.agents[job_id] = agent
        return agent

    async def announce_adopted(self, adopted: list) -> None:
        """A restarted erld took over its predecessor's processes: one event per job says which."""
        for job_id in sorted({p.job for p in adopted}):
            status = await self.store.get(keys.job_status(job_id))
            if status is None:
                continue
            names = ", ".join(p.name for p in adopted if p.job == job_id)
            await self._events(job_id, Path(status["workdir"])).emit(
                EventKind.JOB_ADOPTED, f"adopted running processes: {names}"
            )

    def load_state(self) -> list[dict[str, Any]]:
        if not self.state_file.is_file():
            return []
        return orjson.loads(self.state_file.read_bytes())

    def save_state(self) -> None:
        """Write the process table for the next erld on this node, when it changed since the last write."""
        state = orjson.dumps(self.table.to_state())
        if state != self.saved_state:
            write_file_atomic(self.state_file, state)
            self.saved_state = state

    # --- main loop ------------------------------------------------------------------------

    def summary(self) -> str:
        running = sum(1 for p in self.table.procs.values() if p.state is ProcState.RUNNING)
        role = "leader" if self.leading else "agent"
        slots = "GPU" if self.config.device_kind is DeviceKind.CUDA else "device"
        return (
            f"node {self.node} ({role}): {len(self.agents)} job(s), {running} process(es), "
            f"{self.config.devices} {slots} slots"
        )

    async def start(self) -> asyncio.Task:
        """Join, start following the cluster (the mirror), take over what a previous erld on this node
        left, serve /metrics; returns the lease's keep-alive task."""
        await self.join()
        await self.mirror.start()
        await self.announce_adopted(self.table.adopt(self.load_state()))
        ended = self.pool.end_leftovers({proc.pid for proc in self.table.procs.values()})
        if ended:
            log.info("ended %d pre-imported interpreters a previous erld left", ended)
        keep_alive = asyncio.create_task(self.keep_alive())
        await self.metrics.start()
        self.notifier.ready(self.summary())
        log.info("erld on %s ready (etcd %s)", self.node, self.endpoint)
        return keep_alive

    async def run(self) -> None:
        keep_alive = await self.start()
        while not self.stopping.is_set():
            await self.one_pass()
            await self.until_next_pass()
        keep_alive.cancel()
        await self.mirror.stop()
        await self.shutdown()

    async def one_pass(self) -> None:
        """Read the cluster, decide as the leader if this erld leads, run this node's processes; fenced (a
        lease that may have run out), only tell systemd that the loop lives."""
        if node_action(self.lease_standing()) is NodeAction.FENCE:
            self.last_fenced = time.monotonic()
            self.notifier.watchdog()
            self.notifier.status(f"fenced: etcd has not confirmed the node lease; {self.summary()}")
            return
        try:
            leading = await self.is_leader()
            await self.follow_what_this_node_needs(leading)
            cluster = self.read_cluster()
            await self.drain_before_stopping(cluster)
            since_fenced = None if self.last_fenced is None else time.monotonic() - self.last_fenced
            if leading and may_decide(since_fenced, self.config.lease_ttl_s):
                await self.controller.tick(cluster)
                await self.controller.index_placements(self.read_cluster())
            await self.agent_pass(cluster)
            self.metrics.observe(cluster)
        except NotLeader as exc:
            log.warning("%s", exc)
        except StoreUnavailable as exc:
            log.warning("etcd unreachable this pass: %s", exc)
        except Exception:
            # A pass that fails for another reason (etcd refusing a request, say) is logged and the next
            # pass starts afresh: erld's loop never ends on one.
            log.exception("node %s: this pass failed", self.node)
        self.save_state()
        self.table.reap()
        self.pool.fill()  # after the pass: an interpreter it took is replaced in the background
        self.notifier.watchdog()
        self.notifier.status(self.summary())

    async def until_next_pass(self) -> None:
        """LOOP_INTERVAL_S, or less: a child's exit (SIGCHLD, ``child_exited``) or a stop begins the next
        pass at once, so a dead process is restarted without waiting out the interval."""
        waits = [asyncio.ensure_future(self.stopping.wait()), asyncio.ensure_future(self.child_exit.wait())]
        await asyncio.wait(waits, timeout=LOOP_INTERVAL_S, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        self.child_exit.clear()

    def terminated(self) -> None:
        """SIGTERM: drain this node first when asked to (a second SIGTERM stops at once), else stop."""
        if self.config.drain_on_term_s is None or self.drain_requested is not None:
            self.stopping.set()
        else:
            log.info("SIGTERM: draining node %s within %g s, then stopping", self.node, self.config.drain_on_term_s)
            self.drain_requested = time.time()

    async def drain_before_stopping(self, cluster: Cluster) -> None:
        """Once SIGTERM asked for a drain: record it (under the node lease, so it ends with this erld), and
        stop once no job process is assigned or running here any more, or the time given has run out."""
        if self.drain_requested is None:
            return
        if not self.drain_recorded:
            await start_drain(self.store, self.node, self.config.drain_on_term_s, "SIGTERM", lease=self.lease)
            self.drain_recorded = True
            return
        here = any(
            a["node"] == self.node
            for job_id, procs in cluster.assignments.items()
            if cluster.statuses.get(job_id, {}).get("phase") in ACTIVE_PHASES
            for a in procs.values()
        ) or any(self.table.alive(proc) for proc in self.table.procs.values())  # a lighthouse still needed, say
        if not here or time.time() >= self.drain_requested + self.config.drain_on_term_s:
            self.stopping.set()

    def child_exited(self) -> None:
        self.child_exit.set()

    async def shutdown(self) -> None:
        """SIGTERM: stop every job process cleanly; the jobs stay `running` and resume on restart."""
        self.notifier.stopping()
        for agent in self.agents.values():
            await agent.stop(graceful=True)
            await agent.events.emit(
                EventKind.ERLD_STOPPED, "processes stopped with erld; the job resumes when it starts"
            )
        self.agents.clear()
        self.pool.close()
        self.state_file.unlink(missing_ok=True)
        await self.metrics.stop()
        await self.store.revoke(self.lease)


async def serve(etcd: str | None, config: NodeConfig, state_dir: Path, etcd_port: int) -> None:
    embedded = None
    if etcd is None:
        embedded = EmbeddedEtcd(state_dir, client_port=etcd_port, environment=child_environment())
        await embedded.start()
        etcd = embedded.endpoint
    stop_etcd = embedded is not None
    try:
        # A call that waits on a dead etcd member moves to the next one well within the lease's TTL.
        async with Store(etcd, timeout_s=max(1.0, config.lease_ttl_s / 4)) as store:
            erld = Erld(
                store, etcd, config, state_dir, etcd_started_here=embedded is not None and embedded.adopted_pid is None
            )
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, erld.terminated)
            loop.add_signal_handler(signal.SIGINT, erld.stopping.set)
            loop.add_signal_handler(signal.SIGCHLD, erld.child_exited)
            await erld.run()
    except NodeTaken:
        # An etcd adopted from the erld that holds the node is that erld's: leave it running.
        stop_etcd = stop_etcd and embedded.adopted_pid is None
        raise
    finally:
        if stop_etcd:
            embedded.stop()
