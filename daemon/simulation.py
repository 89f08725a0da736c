"""Many erlds against one real etcd, in one process, with fake processes: the controller at scale.

Each simulated node is a real ``Erld``: it joins under its own lease, renews
it, reads the cluster, leads when it wins the leader key, places and
re-places jobs (``daemon.controller``) and runs its jobs as an agent
(``daemon.agent``), each over its own etcd client, as on a real node. Only
the processes are fake (``FakeProcessTable``): starting one records it as
running and nothing runs, so a thousand nodes fit on one machine.

    async with SimulatedCluster(etcd_endpoint, nodes=100, state_dir=path) as cluster:
        await jobs.submit(cluster.observer, spec, workdir)
        await cluster.placed(spec.name, processes, timeout_s=60)
        cluster.crash("sim-0042")   # the erld dies with its lease unrevoked

Used by ``bench/controller_scale.py`` and ``tests/integration/test_controller_scale.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import signal
import time
from pathlib import Path

from daemon.erld import Erld, NodeConfig
from daemon.proctable import LocalProc, ProcessTable, ProcState
from elastic_rl.store import keys
from elastic_rl.store.client import Store

DEVICES_PER_NODE = 8
JOIN_WAVE = 50
JOIN_WAVE_PAUSE_S = 1.0
JOIN_TIMEOUT_S = 300.0
POLL_S = 0.05


class FakeProcessTable(ProcessTable):
    """A fake, for the simulation only: a started process is a record that runs until signalled."""

    _pids = itertools.count(4_000_000)  # above any real pid: nothing is ever signalled by mistake

    def __init__(self, node: str, etcd_endpoint: str):
        super().__init__(node, etcd_endpoint)
        self.running: set[tuple[str, str]] = set()

    def spawn(self, proc: LocalProc, command, env, workdir, pool=None) -> bool:
        proc.pid, proc.create_time = next(self._pids), time.time()
        proc.state, proc.restart_at, proc.exit_code, proc.serving = ProcState.RUNNING, None, None, False
        self.running.add((proc.job, proc.name))
        return False

    def alive(self, proc: LocalProc) -> bool:
        return (proc.job, proc.name) in self.running

    def signal(self, proc: LocalProc, sig: int) -> None:
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.running.discard((proc.job, proc.name))
            proc.exit_code = -sig

    def kill_strays(self, proc: LocalProc) -> None:
        pass  # no process of a fake table ever outlives its record

    def kill_all(self) -> None:
        self.running.clear()
        self.procs.clear()


class SimulatedErld(Erld):
    """A real erld over a fake process table: no processes to adopt, no pre-imported interpreters, no
    /metrics server (a thousand of them would share one host's ports)."""

    def __init__(self, store: Store, endpoint: str, config: NodeConfig, state_dir: Path):
        super().__init__(store, endpoint, config, state_dir)
        self.table = FakeProcessTable(self.node, endpoint)
        self.pass_seconds: list[float] = []
        self.leases_lost = 0
        self.dead = False
        self._keep_alive: asyncio.Task | None = None

    async def start(self) -> asyncio.Task:
        await self.join()
        await self.mirror.start()
        self._keep_alive = asyncio.create_task(self.keep_alive())
        return self._keep_alive

    async def one_pass(self) -> None:
        started = time.perf_counter()
        await super().one_pass()
        self.pass_seconds.append(time.perf_counter() - started)

    async def rejoin(self) -> None:
        self.leases_lost += 1
        await super().rejoin()

    def crash(self) -> None:
        """Die as a killed erld does: nothing revoked, nothing written; the lease runs out. The main
        loop also ends at its next check, for a task's cancellation can be lost (in Python 3.11,
        ``asyncio.wait_for`` drops one that comes as its call completes) and a dead node must not
        go on joining again."""
        self.dead = True
        self.stopping.set()
        if self._keep_alive is not None:
            self._keep_alive.cancel()
        self.mirror.cancel()

    async def shutdown(self) -> None:
        if not self.dead:
            await super().shutdown()


class SimulatedCluster:
    """``nodes`` simulated erlds named sim-0000, sim-0001, ... with ``DEVICES_PER_NODE`` CPU slots each."""

    def __init__(self, endpoint: str, nodes: int, state_dir: Path, lease_ttl_s: int = 10):
        self.endpoint = endpoint
        self.state_dir = state_dir
        self.names = [f"sim-{index:04d}" for index in range(nodes)]
        self.lease_ttl_s = lease_ttl_s
        self.erlds: dict[str, SimulatedErld] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self._stores: list[Store] = []

    async def __aenter__(self) -> SimulatedCluster:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            store = Store(self.endpoint, timeout_s=max(1.0, self.lease_ttl_s / 4))
            self._stores.append(store)
            config = NodeConfig(name=name, devices=DEVICES_PER_NODE, lease_ttl_s=self.lease_ttl_s)
            self.erlds[name] = SimulatedErld(store, self.endpoint, config, self.state_dir)
        # Started in waves, as a cluster's nodes boot: a thousand sign-ins at once would only time out.
        for start in range(0, len(self.names), JOIN_WAVE):
            for name in self.names[start : start + JOIN_WAVE]:
                self.tasks[name] = asyncio.create_task(self.erlds[name].run(), name=name)
            await asyncio.sleep(JOIN_WAVE_PAUSE_S)
        self.observer = Store(self.endpoint)
        self._stores.append(self.observer)
        await self.until(lambda: self._count(keys.NODES, len(self.names)), JOIN_TIMEOUT_S, "every node joined")
        self.freeze_heap()
        return self

    @staticmethod
    def freeze_heap() -> None:
        """Keep what the erlds hold so far out of the garbage collector's full passes. Each real erld has
        a heap of its own; a thousand in one process share one, and a full collection of it (about a
        second at 1,000 nodes, every two seconds) would stall every erld at once."""
        gc.freeze()

    async def __aexit__(self, *exc_info) -> None:
        for name, erld in self.erlds.items():
            erld.crash()
            self.tasks[name].cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for store in self._stores:
            with contextlib.suppress(Exception):
                await store.close()
        gc.unfreeze()

    def crash(self, name: str) -> None:
        """The node dies: its erld stops mid-loop, its lease unrevoked, its fake processes with it."""
        self.erlds[name].crash()
        self.tasks[name].cancel()

    def pass_seconds(self) -> list[float]:
        return [seconds for erld in self.erlds.values() for seconds in erld.pass_seconds]

    def leases_lost(self) -> int:
        """How many times an erld found its lease gone (or maybe gone) and joined again."""
        return sum(erld.leases_lost for erld in self.erlds.values())

    def following(self, job_id: str) -> int:
        """How many erlds follow the job (the leader, and those running a process of it)."""
        return sum(job_id in erld.records.statuses for erld in self.erlds.values())

    # --- what the bench and the test watch, read by polling etcd as a user's tool would -------------

    async def _count(self, prefix: str, expected: int) -> bool:
        return len(await self.observer.get_prefix(prefix)) >= expected

    async def until(self, condition, timeout_s: float, what: str) -> float:
        """Poll ``condition`` until it holds; returns when it first held (time.monotonic)."""
        deadline = time.monotonic() + timeout_s
        while not await condition():
            for name, task in self.tasks.items():
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise RuntimeError(f"the erld of {name} failed") from task.exception()
            if time.monotonic() > deadline:
                raise TimeoutError(f"not within {timeout_s:.0f} s: {what}")
            await asyncio.sleep(POLL_S)
        return time.monotonic()

    async def assignments(self, job_id: str) -> dict[str, dict]:
        return {keys.last_part(k): v for k, v in (await self.observer.get_prefix(keys.assignments(job_id))).items()}

    async def placed(self, job_id: str, processes: int, timeout_s: float) -> float:
        """When every one of the job's ``processes`` has an assignment."""
        return await self.until(lambda: self._count(keys.assignments(job_id), processes), timeout_s, f"{job_id} placed")

    async def running(self, job_id: str, processes: int, timeout_s: float) -> float:
        """When the agents report every one of the job's processes running."""

        async def all_running() -> bool:
            reported = await self.observer.get_prefix(keys.procs(job_id))
            return sum(record.get("state") == "running" for record in reported.values()) >= processes

        return await self.until(all_running, timeout_s, f"{job_id} running")

    async def settled(self, job_id: str, processes: int, timeout_s: float) -> float:
        """When the own view (its mirror) of every live erld that runs a process of the job has all of
        them running: the changes of a placement reach those erlds before a node death is measured
        against them (an erld that runs none of it does not follow the job)."""

        async def every_view() -> bool:
            return all(
                sum(record.get("state") == "running" for record in erld.records.reported.get(job_id, {}).values())
                >= processes
                for name, erld in self.erlds.items()
                if not self.tasks[name].done() and job_id in erld.agents
            )

        return await self.until(every_view, timeout_s, f"every erld running {job_id} sees it running")

    async def node_gone(self, name: str, timeout_s: float) -> float:
        """When the node's record left etcd (its lease ran out)."""

        async def gone() -> bool:
            return await self.observer.get(keys.node(name)) is None

        return await self.until(gone, timeout_s, f"{name}'s lease ran out")

    async def replaced(self, job_id: str, dead: str, names: set[str], timeout_s: float) -> float:
        """When every process in ``names`` (the dead node's) has an assignment on another node."""

        async def moved() -> bool:
            assigned = await self.assignments(job_id)
            return all(name in assigned and assigned[name]["node"] != dead for name in names)

        return await self.until(moved, timeout_s, f"{job_id}'s processes on {dead} placed again")
