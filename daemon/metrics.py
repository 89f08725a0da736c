"""erld's own HTTP endpoints: ``/metrics`` in Prometheus' text format and ``/healthz``.

    curl http://127.0.0.1:9400/metrics        (the port of `erl daemon --metrics-port`)

Served on the node's advertise host. The figures are those of the cluster as
this erld last read it (each main-loop pass), rendered by ``prometheus-client``
at scrape time: process states and restarts of the processes this node runs,
its pre-imported interpreters (ready or importing), engine health, and for
every job it follows (the leader: every job; another erld: the jobs with a
process on its node) its quorum size, rollouts committed, step and rollout
time, snapshot age, time lost to faults (``policies.fault_time``), stragglers
found (``policies.straggler``), and replicas and engines held against their
range; the state of this node's
device slots; whether any node drains; whether this erld leads.
``/healthz`` answers 200 while the node lease is fresh.

The server reads the erld that runs it through ``ServedNode``, the few
attributes it needs (erld passes itself), and is handed each cluster read by
``MetricsServer.observe``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from checkpoints import layout
from checkpoints.discovery import newest_committed_snapshot
from elastic_rl.event_kinds import EventKind
from elastic_rl.store.job_phase import JobPhase
from policies.fault_time import FAULT_SIGNS, time_lost_to_faults

if TYPE_CHECKING:
    from daemon.cluster import Cluster
    from daemon.pool import InterpreterPool
    from daemon.proctable import ProcessTable

PROC_STATES = ("waiting", "running", "restarting", "displaced", "drained", "exited", "stopped", "failed")


class ServedNode(Protocol):
    """What the endpoints read of the erld they serve: its node and device slots, whether it leads, the
    processes it runs, and whether its node lease may have run out."""

    node: str
    devices: int
    leading: bool
    table: ProcessTable
    pool: InterpreterPool

    def lease_may_have_expired(self) -> bool: ...


def last_rollout(metric: str):
    """A job figure read from the metrics of the job's last reported rollout."""
    return lambda progress, snapshot_age: progress.get("metrics", {}).get(metric)


class ClusterCollector:
    """Builds every metric from the last cluster read, so a gone process or job leaves no stale series."""

    def __init__(self, erld: ServedNode):
        self.erld = erld
        self.cluster: Cluster | None = None

    def collect(self):
        erld, cluster = self.erld, self.cluster
        node = erld.node
        leader = GaugeMetricFamily("erld_is_leader", "1 while this erld is the controller", labels=["node"])
        leader.add_metric([node], 1.0 if erld.leading else 0.0)
        yield leader
        pool = GaugeMetricFamily(
            "erld_pool_interpreters",
            "idle pre-imported interpreters of each kind on this node, ready or still importing",
            labels=["node", "kind", "state"],
        )
        for kind, (ready, importing) in sorted(erld.pool.counts().items()):
            pool.add_metric([node, kind, "ready"], float(ready))
            pool.add_metric([node, kind, "importing"], float(importing))
        yield pool
        if cluster is None:
            return
        states = GaugeMetricFamily(
            "erld_process_state", "1 for the state each job process on this node is in", labels=["job", "proc", "state"]
        )
        # A counter: it only grows while the process lives on this node (Prometheus' rate() reads it).
        restarts = CounterMetricFamily(
            "erld_process_restarts", "restarts of each job process on this node", labels=["job", "proc"]
        )
        engines = GaugeMetricFamily(
            "erld_engine_serving", "1 while an engine on this node is registered and healthy", labels=["job", "engine"]
        )
        for (job, name), proc in sorted(erld.table.procs.items()):
            for state in PROC_STATES:
                states.add_metric([job, name, state], 1.0 if proc.state.value == state else 0.0)
            restarts.add_metric([job, name], float(len(proc.restarts)))
            if name.startswith("engine-"):
                engines.add_metric([job, name], 1.0 if proc.serving else 0.0)
        yield from (states, restarts, engines)

        committed = CounterMetricFamily("erld_job_rollouts_committed", "rollouts the job has trained", labels=["job"])
        jobs = {
            "erld_job_reward_mean": ("mean reward of the last rollout", last_rollout("rollout/reward_mean")),
            "erld_job_generated_tokens_per_second": (
                "tokens the engines generated per second of the last rollout's generation",
                last_rollout("perf/generated_tokens_per_sec"),
            ),
            "erld_job_iteration_time_seconds": (
                "wall time of the last rollout, from the end of the one before",
                last_rollout("perf/iteration_time"),
            ),
            "erld_job_quorum_size": ("trainer replicas in the last step's quorum", last_rollout("train/participants")),
            "erld_job_step_time_seconds": (
                "mean optimizer step time of the last rollout",
                last_rollout("train/step_time"),
            ),
            "erld_job_rollout_time_seconds": ("generation time of the last rollout", last_rollout("rollout/time")),
            "erld_job_straggler_ratio": (
                "the slowest replica's own time per step over its peers' median (mean over the last rollout)",
                last_rollout("train/straggler_ratio"),
            ),
            "erld_job_snapshot_age_seconds": ("seconds since the newest committed snapshot", lambda p, s: s),
            "erld_job_colocation_saved_bytes": (
                "colocated: what two slots of their own would have held for each slot's engine and trainer rank, "
                "less the shared slot's peak, summed over the slots (last rollout)",
                last_rollout("memory/colocation_saved_bytes"),
            ),
        }
        families = {name: GaugeMetricFamily(name, text, labels=["job"]) for name, (text, _) in jobs.items()}
        lost = GaugeMetricFamily(
            "erld_job_time_lost_to_faults_seconds",
            "time the job's faults cost: its rollout intervals with a fault, beyond its usual interval",
            labels=["job"],
        )
        stragglers = CounterMetricFamily(
            "erld_job_stragglers",
            "times a trainer replica was found straggling: replaced, or kept for want of anywhere to go",
            labels=["job", "outcome"],
        )
        slot_memory = GaugeMetricFamily(
            "erld_job_slot_peak_memory_bytes",
            "colocated: each slot's peak memory (its engine's and trainer rank's) in each phase of the last rollout",
            labels=["job", "slot", "phase"],
        )
        for job, status in sorted(cluster.statuses.items()):
            if status.get("phase") != JobPhase.RUNNING:
                continue
            progress = cluster.progress.get(job, {})
            for (slot, phase), peak in slot_peaks(progress.get("metrics", {})).items():
                slot_memory.add_metric([job, slot, phase], peak)
            if "rollouts_done" in progress:
                committed.add_metric([job], float(progress["rollouts_done"]))
            snapshot = newest_committed_snapshot_age(status.get("workdir"))
            for name, (_, value_of) in jobs.items():
                value = value_of(progress, snapshot)
                if value is not None:
                    families[name].add_metric([job], float(value))
            if status.get("workdir"):
                workdir = Path(status["workdir"])
                events = layout.read_lines(layout.events_path(workdir))
                lost.add_metric([job], job_time_lost(workdir, events))
                found = [event for event in events if event["kind"] == EventKind.REPLICA_STRAGGLING]
                stragglers.add_metric([job, "replaced"], float(sum(bool(e.get("replaced")) for e in found)))
                stragglers.add_metric([job, "kept"], float(sum(not e.get("replaced") for e in found)))
        yield committed
        yield from families.values()
        yield lost
        yield stragglers
        yield slot_memory

        sizes = GaugeMetricFamily(
            "erld_job_size",
            "replicas and engines a running job holds, and the least and most its range allows now",
            labels=["job", "kind", "bound"],
        )
        for job, status in sorted(cluster.statuses.items()):
            if status.get("phase") != JobPhase.RUNNING:
                continue
            for kind, bounds in sorted(status.get("size", {}).items()):
                for bound, value in zip(("held", "min", "max"), bounds):
                    sizes.add_metric([job, kind, bound], float(value))
        yield sizes
        draining = GaugeMetricFamily(
            "erld_node_drain_seconds_left",
            "seconds to the drain deadline of each draining node (`erl drain`, --drain-on-term); none: not draining",
            labels=["node"],
        )
        for name, drain in sorted(cluster.draining.items()):
            draining.add_metric([name], max(0.0, drain["deadline"] - time.time()))
        yield draining

        devices = GaugeMetricFamily(
            "erld_device_state", "1 for the state of each device slot of this node", labels=["node", "device", "state"]
        )
        for device in range(erld.devices):
            failed = device in cluster.failed.get(node, set())
            devices.add_metric([node, str(device), "failed"], 1.0 if failed else 0.0)
            devices.add_metric([node, str(device), "healthy"], 0.0 if failed else 1.0)
        yield devices


def slot_peaks(metrics: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(slot, phase) -> peak bytes, from a colocated job's ``memory/<node>/<slot>/<phase>_peak_bytes`` figures."""
    peaks = {}
    for key, value in metrics.items():
        if key.startswith("memory/") and key.endswith("_peak_bytes"):
            slot, _, phase = key.removeprefix("memory/").removesuffix("_peak_bytes").rpartition("/")
            if slot:
                peaks[(slot, phase)] = float(value)
    return peaks


def job_time_lost(workdir: Path, events: list[dict[str, Any]]) -> float:
    """``policies.fault_time`` over the job's metrics.jsonl and its events, as of now."""
    trained = [line["time"] for line in layout.read_lines(layout.metrics_lines_path(workdir))]
    faults = [event["time"] for event in events if event["kind"] in FAULT_SIGNS]
    return time_lost_to_faults(trained, faults, time.time())


def newest_committed_snapshot_age(workdir: str | None) -> float | None:
    snapshot = newest_committed_snapshot(Path(workdir)) if workdir else None
    return None if snapshot is None else time.time() - snapshot.path.stat().st_mtime


class MetricsServer:
    def __init__(self, erld: ServedNode, host: str, port: int | None):
        self.erld, self.host, self.port = erld, host, port
        self.collector = ClusterCollector(erld)
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        self.runner: web.AppRunner | None = None

    def observe(self, cluster: Cluster) -> None:
        self.collector.cluster = cluster

    async def start(self) -> None:
        if self.port is None:
            return
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        if self.erld.lease_may_have_expired():
            return web.Response(status=503, text="node lease not renewed within its TTL\n")
        return web.Response(text="ok\n")
