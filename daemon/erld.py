"""erld, the node daemon: membership in etcd, job placement, and supervision of job processes.

    erl daemon [--etcd URL] [--cpu-devices N] [--state-dir DIR]

Every erld registers its node and device slots under a lease. One of them holds
the leader key and places pending jobs on nodes (``policies.placement``); each
erld runs the jobs placed on its own node (``daemon.job``). With no ``--etcd``
it starts an embedded etcd under its state dir. Under systemd it sends
READY=1 once etcd and membership are up, WATCHDOG=1 from a main loop that is
making progress, a one-line STATUS=, and STOPPING=1 on SIGTERM, after which it
stops its jobs' processes and revokes its lease. Jobs left running when erld
stopped or crashed are picked up when it starts again.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from pathlib import Path
from typing import Any

import orjson

from elastic_rl.events import EventLog
from daemon.devices import free_device_slots, job_statuses
from daemon.job import JobRunner, devices_needed
from daemon.notify import SystemdNotifier, child_environment
from elastic_rl.atomic import write_file_atomic
from elastic_rl.config import JobSpec
from elastic_rl.errors import ElasticRLError
from elastic_rl.store import keys
from elastic_rl.store.client import LeaseExpired, Store, StoreUnavailable
from elastic_rl.store.embedded import EmbeddedEtcd
from policies.placement import place_job

log = logging.getLogger("erld")

LEASE_TTL_S = 10
LOOP_INTERVAL_S = 0.5


class Erld:
    def __init__(self, store: Store, endpoint: str, node: str, cpu_devices: int, state_dir: Path):
        self.store = store
        self.endpoint = endpoint
        self.node = node
        self.cpu_devices = cpu_devices
        self.state_dir = state_dir
        self.state_file = state_dir / f"jobs-{node}.json"
        self.notifier = SystemdNotifier()
        self.runners: dict[str, JobRunner] = {}
        self.lease = None
        self.stopping = asyncio.Event()

    # --- membership ---------------------------------------------------------------

    async def join(self) -> None:
        self.lease = await self.store.lease(LEASE_TTL_S)
        await self.store.put(
            keys.node(self.node), {"devices": self.cpu_devices, "started": time.time()}, lease=self.lease
        )
        for index in range(self.cpu_devices):
            await self.store.put(keys.device(self.node, index), {"kind": "cpu", "state": "healthy"}, lease=self.lease)
        for runner in self.runners.values():
            runner.lease = self.lease

    async def keep_alive(self) -> None:
        """Refresh the node lease on its own schedule, so a busy main loop never loses membership."""
        while not self.stopping.is_set():
            try:
                await self.store.refresh(self.lease)
            except LeaseExpired as exc:
                log.warning("%s; joining again", exc)
                await self.join()
            except StoreUnavailable as exc:
                log.warning("lease refresh failed: %s", exc)
            await asyncio.sleep(LEASE_TTL_S / 4)

    async def is_leader(self) -> bool:
        if await self.store.create(keys.LEADER, self.node, lease=self.lease):
            log.info("%s is the leader", self.node)
        return await self.store.get(keys.LEADER) == self.node

    # --- the controller (leader only) -------------------------------------------------

    async def place_pending(self, statuses: dict[str, dict[str, Any]]) -> None:
        for job_id, status in sorted(statuses.items(), key=lambda item: item[1].get("submitted", 0)):
            if status.get("phase") != "pending":
                continue
            spec = JobSpec.model_validate(await self.store.get(keys.job_spec(job_id)))
            needed = devices_needed(spec)
            free = await free_device_slots(self.store, statuses)
            placement = place_job(needed, free)
            if placement.node is None:
                if status.get("reason") != placement.reason:
                    await self.store.modify(keys.job_status(job_id), lambda s: {**s, "reason": placement.reason})
                continue
            placed = {"phase": "running", "node": placement.node, "devices": free[placement.node][:needed], "reason": ""}
            statuses[job_id] = await self.store.modify(
                keys.job_status(job_id), lambda s: {**s, **placed} if s.get("phase") == "pending" else s
            )

    # --- the node agent -------------------------------------------------------------------

    async def set_phase(self, job_id: str, phase: str, reason: str = "") -> None:
        ended = {"phase": phase, "reason": reason, "ended": time.time()}
        await self.store.modify(keys.job_status(job_id), lambda status: {**(status or {}), **ended})

    async def reconcile(self, statuses: dict[str, dict[str, Any]]) -> None:
        for job_id, status in statuses.items():
            mine = status.get("node") == self.node
            runner = self.runners.get(job_id)
            if mine and status.get("phase") == "running" and runner is None:
                await self.start_job(job_id, status)
            elif mine and status.get("phase") == "stopping":
                if runner is not None:
                    await runner.stop()
                    await runner.events.emit("job_stopped", "stopped by request")
                    del self.runners[job_id]
                await self.set_phase(job_id, "stopped", "stopped by request")
        for job_id, runner in list(self.runners.items()):
            try:
                await runner.tick(statuses.get(job_id))
            except ElasticRLError as exc:
                runner.outcome = f"failed: {exc}"
            if runner.outcome is not None:
                await runner.stop()
                phase, _, reason = runner.outcome.partition(": ")
                await self.set_phase(job_id, phase, reason)
                del self.runners[job_id]
        self.save_state()

    async def start_job(self, job_id: str, status: dict[str, Any]) -> None:
        spec = JobSpec.model_validate(await self.store.get(keys.job_spec(job_id)))
        workdir = Path(status["workdir"])
        events = EventLog(self.store, job_id, workdir, self.node)
        runner = JobRunner(
            job_id, spec, workdir, status["devices"], self.store, self.endpoint, events, self.node, lease=self.lease
        )
        self.runners[job_id] = runner
        # Starting takes seconds (initial weights, engines loading): off the main loop.
        runner.launch(self.load_state().get(job_id))

    def load_state(self) -> dict[str, Any]:
        if not self.state_file.is_file():
            return {}
        return orjson.loads(self.state_file.read_bytes())

    def save_state(self) -> None:
        state = {job_id: runner.to_state() for job_id, runner in self.runners.items()}
        write_file_atomic(self.state_file, orjson.dumps(state))

    # --- main loop ------------------------------------------------------------------------

    def summary(self) -> str:
        return f"node {self.node}: {len(self.runners)} job(s) running, {self.cpu_devices} device slots"

    async def run(self) -> None:
        await self.join()
        keep_alive = asyncio.create_task(self.keep_alive())
        self.notifier.ready(self.summary())
        log.info("erld on %s ready (etcd %s)", self.node, self.endpoint)
        while not self.stopping.is_set():
            statuses = await job_statuses(self.store)
            if await self.is_leader():
                await self.place_pending(statuses)
            await self.reconcile(statuses)
            self.notifier.watchdog()
            self.notifier.status(self.summary())
            try:
                await asyncio.wait_for(self.stopping.wait(), LOOP_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
        keep_alive.cancel()
        await self.shutdown()

    async def shutdown(self) -> None:
        """SIGTERM: stop every job process cleanly; the jobs stay `running` and resume on restart."""
        self.notifier.stopping()
        for runner in self.runners.values():
            await runner.stop()
            await runner.events.emit("erld_stopped", "processes stopped with erld; the job resumes when it starts")
        self.runners.clear()
        if self.state_file.exists():
            self.state_file.unlink()
        await self.store.revoke(self.lease)


async def serve(etcd: str | None, cpu_devices: int, state_dir: Path, node: str | None, etcd_port: int) -> None:
    embedded = None
    if etcd is None:
        embedded = EmbeddedEtcd(state_dir, client_port=etcd_port, environment=child_environment())
        await embedded.start()
        etcd = embedded.endpoint
    try:
        async with Store(etcd) as store:
            erld = Erld(store, etcd, node or socket.gethostname(), cpu_devices, state_dir)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, erld.stopping.set)
            await erld.run()
    finally:
        if embedded is not None:
            embedded.stop()
