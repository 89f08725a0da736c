"""Runs one job's processes on this node: starts them in order, supervises, restarts, stops.

The processes of a job: the torchft lighthouse, the engines, the trainer ranks,
the router (with the engines registered once healthy) and the orchestrator.
Each runs in its own session with its output appended to
``workdir/logs/<proc>.log``, so it outlives a crash of erld: a restarted erld
adopts the processes still alive (by pid and start time, from its state file)
and restarts the rest. An unexpected exit is handled by the restart policy;
when the orchestrator exits 0 the job has succeeded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elastic_rl.events import EventLog
from daemon.notify import child_environment
from elastic_rl import jobenv
from elastic_rl.config import JobSpec
from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.launcher import engine_command
from elastic_rl.engines.router import RouterClient, router_command
from elastic_rl.errors import ElasticRLError
from elastic_rl.net import LOOPBACK, free_port, url
from elastic_rl.store import keys
from elastic_rl.store.client import Store
from policies.restart import RestartPolicy, decide_restart

log = logging.getLogger("erld.job")


@dataclass
class ProcPlan:
    name: str
    role: str
    command: list[str]
    env: dict[str, str]
    port: int | None = None
    device: int | None = None


@dataclass
class ProcRecord:
    plan: ProcPlan
    pid: int | None = None
    create_time: float | None = None
    restarts: list[float] = field(default_factory=list)
    state: str = "pending"
    restart_at: float | None = None
    exit_code: int | None = None


def devices_needed(spec: JobSpec) -> int:
    return spec.engines.count + spec.trainer.replicas * spec.trainer.tensor_parallel


class JobFailed(ElasticRLError):
    """A job process used up its restart budget, or the job could not start."""


class JobRunner:
    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        workdir: Path,
        devices: list[int],
        store: Store,
        etcd_endpoint: str,
        events: EventLog,
        lease=None,
    ):
        self.job_id = job_id
        self.spec = spec
        self.workdir = workdir
        self.devices = devices
        self.store = store
        self.etcd_endpoint = etcd_endpoint
        self.events = events
        # Process records are bound to erld's node lease: they vanish with a dead erld.
        self.lease = lease
        self.policy = RestartPolicy(spec.fault_tolerance.max_restarts, spec.fault_tolerance.restart_window_s)
        self.procs: dict[str, ProcRecord] = {}
        self.children: dict[str, subprocess.Popen] = {}
        self.outcome: str | None = None  # "succeeded" or "failed: <reason>"
        self._starting: asyncio.Task | None = None

    # --- the plan ---------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        return {
            **child_environment(),
            jobenv.JOB: self.job_id,
            jobenv.WORKDIR: str(self.workdir),
            jobenv.ETCD: self.etcd_endpoint,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }

    def plan(self) -> list[ProcPlan]:
        spec = self.spec
        base = self._base_env()
        devices = iter(self.devices)
        lighthouse_port, router_port = free_port(), free_port()
        shared = {**base, jobenv.ROUTER_URL: url(router_port), jobenv.LIGHTHOUSE_URL: url(lighthouse_port)}
        plans = [
            ProcPlan(
                "lighthouse",
                "lighthouse",
                [
                    str(Path(sys.executable).parent / "torchft_lighthouse"),
                    "--min_replicas", "1",
                    "--bind", f"{LOOPBACK}:{lighthouse_port}",
                    "--heartbeat_timeout_ms", str(spec.fault_tolerance.heartbeat_timeout_ms),
                    "--join_timeout_ms", "100",
                ],  # fmt: skip
                shared,
                port=lighthouse_port,
            )
        ]
        for index in range(spec.engines.count):
            port, device = free_port(), next(devices)
            plans.append(ProcPlan(f"engine-{index}", "engine", [], {**shared, jobenv.DEVICE: str(device)}, port, device))
        for replica in range(spec.trainer.replicas):
            master_port = free_port()
            for rank in range(spec.trainer.tensor_parallel):
                device = next(devices)
                env = {
                    **shared,
                    jobenv.REPLICA: str(replica),
                    jobenv.DEVICE: str(device),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(spec.trainer.tensor_parallel),
                    "MASTER_ADDR": LOOPBACK,
                    "MASTER_PORT": str(master_port),
                }
                command = [sys.executable, "-m", "elastic_rl.trainer.main"]
                plans.append(ProcPlan(f"trainer-{replica}-{rank}", "trainer", command, env, device=device))
        plans.append(
            ProcPlan("router", "router", router_command(router_port, free_port()), shared, port=router_port)
        )
        plans.append(
            ProcPlan("orchestrator", "orchestrator", [sys.executable, "-m", "elastic_rl.rollout.orchestrator"], shared)
        )
        return plans

    def _command(self, plan: ProcPlan) -> list[str]:
        """Engines start on the newest weights, so a replacement serves the current version."""
        if plan.role != "engine":
            return plan.command
        version = jobenv.latest_weights_version(self.workdir) or 0
        return engine_command(
            self.spec.engines,
            jobenv.weights_dir(self.workdir, version),
            plan.port,
            weight_version=str(version),
            deterministic=self.spec.rollout.deterministic,
        )

    # --- processes --------------------------------------------------------------

    def _kill_strays(self, name: str) -> None:
        """Kill processes of this job named ``name`` that no record knows.

        An erld killed between starting a process and saving its state leaves such
        an orphan behind; it would hold the port its replacement needs.
        """
        for process in psutil.process_iter(["pid"]):
            try:
                environ = process.environ()
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            if environ.get(jobenv.JOB) == self.job_id and environ.get(jobenv.PROC) == name:
                log.warning("job %s: killing stray %s (pid %d)", self.job_id, name, process.pid)
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _spawn(self, record: ProcRecord) -> None:
        plan = record.plan
        self._kill_strays(plan.name)
        log_path = self.workdir / "logs" / f"{plan.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                self._command(plan),
                env={**plan.env, jobenv.PROC: plan.name},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=os.getcwd(),
            )
        self.children[plan.name] = process
        record.pid = process.pid
        record.create_time = psutil.Process(process.pid).create_time()
        record.state = "running"
        record.restart_at = None
        record.exit_code = None

    def _alive(self, record: ProcRecord) -> bool:
        child = self.children.get(record.plan.name)
        if child is not None:
            if child.poll() is None:
                return True
            record.exit_code = child.returncode
            return False
        if record.pid is None:
            return False
        try:
            process = psutil.Process(record.pid)
            return process.create_time() == record.create_time and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _signal(self, record: ProcRecord, sig: int) -> None:
        if record.pid is not None and self._alive(record):
            try:
                os.killpg(record.pid, sig)
            except ProcessLookupError:
                pass

    async def _publish(self, record: ProcRecord) -> None:
        plan = record.plan
        await self.store.put(
            keys.proc(self.job_id, plan.name),
            {
                "role": plan.role,
                "state": record.state,
                "pid": record.pid,
                "port": plan.port,
                "device": plan.device,
                "restarts": len(record.restarts),
                "exit_code": record.exit_code,
            },
            lease=self.lease,
        )

    # --- lifecycle --------------------------------------------------------------

    def launch(self, saved_state: dict[str, Any] | None) -> None:
        """Start the job (or adopt a previous erld's processes) in the background."""
        self._starting = asyncio.create_task(self.adopt(saved_state) if saved_state else self.start())

    async def _start_finished(self) -> bool:
        if self._starting is None:
            return True
        if not self._starting.done():
            return False
        starting, self._starting = self._starting, None
        error = starting.exception()
        if error is not None:
            self.outcome = f"failed: {error}"
            await self.events.emit("job_failed", str(error))
        return True

    async def start(self) -> None:
        """Start every process in order; engines are registered with the router once healthy."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        jobenv.write_spec(self.workdir, self.spec)
        await self._prepare_initial_weights()
        for plan in self.plan():
            self.procs[plan.name] = ProcRecord(plan)
        for record in self.procs.values():
            if record.plan.role != "orchestrator":
                self._spawn(record)
                await self._publish(record)
        await self._register_engines()
        orchestrator = self.procs["orchestrator"]
        self._spawn(orchestrator)
        await self._publish(orchestrator)
        await self.events.emit("job_started", f"{len(self.procs)} processes on devices {self.devices}")

    async def _prepare_initial_weights(self) -> None:
        if jobenv.weights_dir(self.workdir, 0).exists():
            return
        log_path = self.workdir / "logs" / "init-weights.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "elastic_rl.model.export",
                str(self.workdir / jobenv.SPEC_FILE), str(jobenv.weights_dir(self.workdir, 0)),
                stdout=log_file, stderr=subprocess.STDOUT, env=self._base_env(),
            )  # fmt: skip
            code = await process.wait()
        if code != 0:
            raise JobFailed(f"exporting the initial weights failed (exit {code}); see {log_path}")

    async def _register_engines(self, only: str | None = None) -> None:
        """Register engines with the router; a replaced engine is removed first, which resets
        what the router remembers of its predecessor (an open circuit, its load)."""
        router = RouterClient(url(self.procs["router"].plan.port))
        await router.wait_healthy(60)
        for record in self.procs.values():
            if record.plan.role != "engine" or (only is not None and record.plan.name != only):
                continue
            engine_url = url(record.plan.port)
            await EngineClient(engine_url).wait_healthy(self.spec.engines.startup_timeout_s)
            if engine_url in await router.worker_urls():
                if only is None:
                    continue
                await router.remove_worker(engine_url)
            await router.add_worker(engine_url)

    async def tick(self) -> None:
        """One supervision pass: notice exits, restart after backoff, or settle the outcome."""
        if not await self._start_finished() or self.outcome is not None:
            return
        now = time.time()
        for record in self.procs.values():
            if record.state == "running" and not self._alive(record):
                await self._on_exit(record, now)
                if self.outcome is not None:
                    return
            elif record.state == "restarting" and record.restart_at is not None and now >= record.restart_at:
                record.restarts.append(now)
                self._spawn(record)
                await self._publish(record)
                await self.events.emit("proc_restarted", f"restart {len(record.restarts)}", proc=record.plan.name)
                if record.plan.role in ("engine", "router"):
                    await self._register_engines(only=record.plan.name if record.plan.role == "engine" else None)

    async def _on_exit(self, record: ProcRecord, now: float) -> None:
        name = record.plan.name
        if record.plan.role == "orchestrator" and await self._finished():
            record.state = "exited"
            await self._publish(record)
            self.outcome = "succeeded"
            await self.events.emit("job_succeeded", "every rollout trained")
            return
        decision = decide_restart(self.policy, record.restarts, now)
        await self.events.emit(
            "proc_exited", f"exit code {record.exit_code}; see logs/{name}.log", proc=name, exit_code=record.exit_code
        )
        if not decision.restart:
            record.state = "failed"
            await self._publish(record)
            self.outcome = f"failed: {name} {decision.reason}; last exit code {record.exit_code}; see logs/{name}.log"
            await self.events.emit("job_failed", self.outcome, proc=name)
            return
        record.state = "restarting"
        record.restart_at = now + decision.delay_s
        await self._publish(record)

    async def _finished(self) -> bool:
        progress = await self.store.get(keys.job_progress(self.job_id)) or {}
        return bool(progress.get("finished"))

    async def stop(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        for record in self.procs.values():
            self._signal(record, signal.SIGTERM)
        deadline = time.monotonic() + self.spec.fault_tolerance.stop_grace_s
        while time.monotonic() < deadline and any(self._alive(r) for r in self.procs.values()):
            await asyncio.sleep(0.1)
        for record in self.procs.values():
            self._signal(record, signal.SIGKILL)
            if record.state in ("running", "restarting"):
                record.state = "stopped"
                await self._publish(record)
        for child in self.children.values():
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    # --- adoption across erld restarts -------------------------------------------

    def to_state(self) -> dict[str, Any]:
        return {"devices": self.devices, "procs": {name: asdict(r) for name, r in self.procs.items()}}

    async def adopt(self, state: dict[str, Any]) -> None:
        """Take over the processes a previous erld started; restart the ones that died."""
        for name, raw in state["procs"].items():
            record = ProcRecord(**{**raw, "plan": ProcPlan(**raw["plan"])})
            self.procs[name] = record
        adopted = []
        for record in self.procs.values():
            if record.state != "running":
                continue
            if self._alive(record):
                adopted.append(record.plan.name)
            else:
                await self._on_exit(record, time.time())
                if self.outcome is not None:
                    return
            await self._publish(record)
        await self.events.emit("job_adopted", f"adopted running processes: {', '.join(adopted) or 'none'}")
