"""The machines a chaos scenario (or a test) runs a job on: erlds and etcd, as real processes on this host.

``Topology.single`` is one erld with its embedded etcd. ``Topology.cluster``
is an etcd of several members on loopback and one erld per node, each with
its own node name, state dir and device slots; the nodes share the work dir
(one folder here, a shared filesystem in production). Every piece can be
failed the way hardware fails: an erld SIGKILLed (and restarted, as systemd
would) or frozen (SIGSTOP), a whole node killed (its erld and every process
it started), an etcd member killed, and, where each node reaches etcd through
a proxy of its own, a node cut off from etcd (a partition).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from daemon.pool import POOL_NODE
from elastic_rl import jobenv
from elastic_rl.net import LOOPBACK, free_port
from elastic_rl.store import keys
from elastic_rl.store.client import Store, StoreUnavailable, etcd_answers
from elastic_rl.store.embedded import etcd_command

REPO = Path(__file__).resolve().parent.parent


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.client_port}"

    @property
    def peer(self) -> str:
        return f"{self.name}=http://{LOOPBACK}:{self.peer_port}"


class EtcdCluster:
    def __init__(self, root: Path, size: int = 3):
        self.members = [EtcdMember(f"etcd-{i}", free_port(), free_port(), root / f"etcd-{i}") for i in range(size)]

    @property
    def endpoint(self) -> str:
        return ",".join(member.endpoint for member in self.members)

    def start(self, timeout_s: float = 60.0) -> None:
        for member in self.members:
            self._launch(member)
        deadline = time.monotonic() + timeout_s
        while not asyncio.run(etcd_answers(self.endpoint)):
            assert time.monotonic() < deadline, "the etcd cluster did not come up"
            time.sleep(0.2)

    def _launch(self, member: EtcdMember) -> None:
        """Start a member; one that ran before rejoins with its data (etcd ignores the initial cluster then)."""
        initial = ",".join(each.peer for each in self.members)
        member.data_dir.parent.mkdir(parents=True, exist_ok=True)
        log = open(member.data_dir.parent / f"{member.name}.log", "ab")
        member.process = subprocess.Popen(
            etcd_command(member.data_dir, member.client_port, member.peer_port, member.name, initial),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, index: int) -> None:
        process = self.members[index].process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=10)

    def restart(self, index: int) -> None:
        """Start a killed member again, as its machine coming back would."""
        if self.members[index].process is None or self.members[index].process.poll() is not None:
            self._launch(self.members[index])

    def stop(self) -> None:
        for index in range(len(self.members)):
            self.kill(index)


class NodeLink:
    """One node's way to etcd through its own proxy (``chaos.etcd_proxy``), which a partition cuts."""

    def __init__(self, etcd: EtcdCluster, log_dir: Path):
        self.pairs = [(free_port(), member.client_port) for member in etcd.members]
        self.log_dir = log_dir
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return ",".join(f"http://{LOOPBACK}:{listen}" for listen, _ in self.pairs)

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "chaos.etcd_proxy", *(f"{listen}:{etcd}" for listen, etcd in self.pairs)],
            cwd=REPO,
            stdout=open(self.log_dir / "etcd-proxy.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not asyncio.run(etcd_answers(self.endpoint)):
            assert self.process.poll() is None and time.monotonic() < deadline, "the etcd proxy did not come up"
            time.sleep(0.2)

    def cut(self) -> None:
        self.process.send_signal(signal.SIGUSR1)

    def heal(self) -> None:
        self.process.send_signal(signal.SIGUSR2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@dataclass
class ErldNode:
    name: str
    state_dir: Path
    cpu_devices: int
    etcd: str | None
    """The etcd members' endpoint; None: the erld starts an embedded etcd on ``etcd_port``."""
    etcd_port: int = 0
    lease_ttl_s: int = 10
    metrics_port: int | None = None
    environment: dict[str, str] = field(default_factory=dict)
    """Set for the erld and so for every job process it starts (fault injection reaches trainers so)."""
    gpus: str | None = None
    """`all` or a count: the node offers its GPUs (`erl daemon --gpus`) instead of ``cpu_devices``."""
    pool: dict[str, int] | None = None
    """Idle pre-imported interpreters per process kind (`erl daemon --pool`); None: erld's defaults."""
    drain_on_term_s: float | None = None
    """On SIGTERM the erld drains its node within this many seconds (`erl daemon --drain-on-term`)."""
    slot_memory_gib: float | None = None
    """The memory one CPU slot may use (`erl daemon --slot-memory`); None: not known."""
    link: NodeLink | None = None
    """The node's own proxy to etcd, which a partition cuts (its ``etcd`` is then the proxy's endpoint)."""
    process: subprocess.Popen | None = None

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        where = ["--etcd", self.etcd] if self.etcd else ["--etcd-port", str(self.etcd_port)]
        metrics = ["--metrics-port", str(self.metrics_port)] if self.metrics_port else []
        slots = ["--gpus", self.gpus] if self.gpus else ["--cpu-devices", str(self.cpu_devices)]
        pool = [arg for kind, size in (self.pool or {}).items() for arg in ("--pool", f"{kind}={size}")]
        drain = ["--drain-on-term", str(self.drain_on_term_s)] if self.drain_on_term_s else []
        memory = ["--slot-memory", str(self.slot_memory_gib)] if self.slot_memory_gib else []
        log = open(self.state_dir / "erld.log", "ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "elastic_rl.cli",
                "daemon",
                "--node",
                self.name,
                "--state-dir",
                str(self.state_dir),
                *slots,
                "--lease-ttl",
                str(self.lease_ttl_s),
                *where,
                *metrics,
                *pool,
                *drain,
                *memory,
            ],
            cwd=REPO,
            env={**os.environ, **self.environment},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    @property
    def endpoint(self) -> str:
        return self.etcd or f"http://{LOOPBACK}:{self.etcd_port}"

    def ready_interpreters(self) -> dict[str, int]:
        """Per process kind, the idle pre-imported interpreters whose imports are done, from this erld's
        ``/metrics`` (it needs a ``metrics_port``)."""
        page = urllib.request.urlopen(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=10).read()
        ready = {}
        for family in text_string_to_metric_families(page.decode()):
            for sample in family.samples:
                if sample.name == "erld_pool_interpreters" and sample.labels["state"] == "ready":
                    ready[sample.labels["kind"]] = int(sample.value)
        return ready

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until this node is a member (its node key names this erld's pid)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, (self.state_dir / "erld.log").read_text()[-3000:]
            if asyncio.run(_node_pid(self.endpoint, self.name)) == self.process.pid:
                return
            assert time.monotonic() < deadline, f"erld {self.name} did not join"
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the erld alone: its job processes run on (until a restarted erld adopts them)."""
        self.process.kill()
        self.process.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()
        self.wait_ready()

    def kill_node(self) -> list[int]:
        """The whole node dies: its erld and every job process it started. Returns their pids."""
        victims = self._job_processes()
        self.process.kill()
        for victim in victims:
            try:
                victim.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=10)
        return [victim.pid for victim in victims]

    def freeze(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.kill_node()

    def job_pids(self) -> set[int]:
        return {process.pid for process in self._job_processes()}

    def _job_processes(self) -> list[psutil.Process]:
        """The processes this erld started, its pool's interpreters included: its node name on this
        topology's etcd (another topology's, a concurrent test session's, may share the name), or, while
        the erld lives, its children. A process that was a pooled interpreter shows the pool's environment,
        not its job's, in /proc; the router shows none (it writes its process title over it)."""
        found = {
            p.pid: p
            for p in psutil.process_iter(["pid"])
            if self.name in ((env := _env_of(p)).get(jobenv.NODE), env.get(POOL_NODE))
            and env.get(jobenv.ETCD) == self.endpoint
        }
        with contextlib.suppress(psutil.NoSuchProcess):
            if self.process is not None and self.etcd is not None:  # an erld with its own etcd keeps it
                found.update({p.pid: p for p in psutil.Process(self.process.pid).children(recursive=True)})
        return list(found.values())


def _env_of(process: psutil.Process) -> dict[str, str]:
    try:
        return process.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return {}


async def _node_pid(endpoint: str, node: str) -> int | None:
    async with Store(endpoint, timeout_s=2.0, attempts=1) as store:
        try:
            record = await store.get(keys.node(node))
        except StoreUnavailable:
            return None
    return None if record is None else record.get("pid")


async def _leader(endpoint: str) -> str | None:
    async with Store(endpoint, timeout_s=2.0, attempts=2) as store:
        try:
            return await store.get(keys.LEADER)
        except StoreUnavailable:
            return None


class Topology:
    """Erlds and their etcd for the length of a ``with`` block; ``endpoint`` is what `erl` is pointed at."""

    def __init__(self, nodes: list[ErldNode], etcd: EtcdCluster | None = None):
        self.nodes, self.etcd = nodes, etcd

    @classmethod
    def single(
        cls,
        root: Path,
        cpu_devices: int = 8,
        environment: dict[str, str] | None = None,
        name: str = "node-0",
        gpus: str | None = None,
        pool: dict[str, int] | None = None,
        metrics: bool = False,
        slot_memory_gib: float | None = None,
    ) -> Topology:
        """One erld with an embedded etcd; ``metrics``: serving ``/metrics`` on a free port."""
        node = ErldNode(
            name,
            root / name,
            cpu_devices,
            None,
            etcd_port=free_port(),
            metrics_port=free_port() if metrics else None,
            environment=environment or {},
            gpus=gpus,
            pool=pool,
            slot_memory_gib=slot_memory_gib,
        )
        return cls([node])

    @classmethod
    def cluster(
        cls,
        root: Path,
        nodes: int = 3,
        cpu_devices: int = 4,
        etcd_members: int = 3,
        lease_ttl_s: int = 4,
        environment: dict[str, str] | None = None,
        pool: dict[str, int] | None = None,
        drain_on_term_s: float | None = None,
        *,
        partitionable: bool = False,
    ) -> Topology:
        """``partitionable``: each node reaches etcd through a proxy of its own (``NodeLink``)."""
        etcd = EtcdCluster(root / "etcd", etcd_members)
        made = []
        for i in range(nodes):
            link = NodeLink(etcd, root / f"node-{i}") if partitionable else None
            made.append(
                ErldNode(
                    f"node-{i}",
                    root / f"node-{i}",
                    cpu_devices,
                    link.endpoint if link else etcd.endpoint,
                    lease_ttl_s=lease_ttl_s,
                    environment=environment or {},
                    pool=pool,
                    drain_on_term_s=drain_on_term_s,
                    link=link,
                )
            )
        return cls(made, etcd)

    @property
    def endpoint(self) -> str:
        return self.etcd.endpoint if self.etcd else self.nodes[0].endpoint

    def join(self, cpu_devices: int, **overrides: Any) -> ErldNode:
        """A new erld joins, set up as the first one (its etcd, lease, pool, environment, unless
        ``overrides`` sets one otherwise) with ``cpu_devices`` slots; it is stopped with the others."""
        first = self.nodes[0]
        name = f"node-{len(self.nodes)}"
        settings = {
            "lease_ttl_s": first.lease_ttl_s,
            "environment": first.environment,
            "pool": first.pool,
            "drain_on_term_s": first.drain_on_term_s,
        }
        node = ErldNode(name, first.state_dir.parent / name, cpu_devices, self.endpoint, **{**settings, **overrides})
        node.start()
        self.nodes.append(node)
        node.wait_ready()
        return node

    def node(self, name: str) -> ErldNode:
        return next(node for node in self.nodes if node.name == name)

    def leader(self) -> str | None:
        return asyncio.run(_leader(self.endpoint))

    def __enter__(self) -> Topology:
        if self.etcd is not None:
            self.etcd.start()
        for node in self.nodes:
            if node.link is not None:
                node.link.start()
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.wait_ready()
        return self

    def __exit__(self, *exc_info) -> None:
        for node in self.nodes:
            if node.link is not None:
                node.link.heal()  # an erld cut off from etcd could not stop its processes cleanly
        for node in self.nodes:
            node.stop()
            if node.link is not None:
                node.link.stop()
        if self.etcd is not None:
            self.etcd.stop()
        else:
            _stop_embedded_etcd(self.nodes[0].state_dir)


def _stop_embedded_etcd(state_dir: Path) -> None:
    """The embedded etcd of a SIGKILLed erld may still run: stop it by its pid file."""
    pid_file = state_dir / "etcd.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
