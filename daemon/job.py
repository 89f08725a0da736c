"""Runs one job's processes on this node: starts them in order, supervises, restarts, stops.

The processes of a job: the torchft lighthouse, the engines, the trainer ranks
(``trainer.replicas`` replicas of ``trainer.tensor_parallel`` ranks each), the
router (with the engines registered once healthy) and the orchestrator.
Each runs in its own session with its output appended to
``workdir/logs/<proc>.log``, so it outlives a crash of erld: a restarted erld
adopts the processes still alive (by pid and start time, from its state file)
and restarts the rest. An unexpected exit is handled by the restart policy;
when the orchestrator exits 0 the job has succeeded.

A trainer replica lives and dies as a group: when one rank exits, the other
ranks of its replica (stuck in their tensor-parallel collectives) are killed
and the replica restarts whole, then heals from a peer, or an idle warm spare
(``fault_tolerance.warm_spares``: trainer processes with the model built,
waiting) takes its place at once and a new spare starts. Two trainer exit codes
are requests: a rollback (restart at once) and a quarantined device (the
device is marked failed and the replica moves to a free one, or the job runs
on without it). Engines are watched through ``/health_generate``
(``policies.engine_health``); an unhealthy one is taken out of the router,
killed and replaced on the newest weights. ``erl scale`` changes the engine
count of a running job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import psutil

from elastic_rl.events import EventLog
from daemon.devices import free_device_slots, job_statuses, mark_failed
from daemon.notify import child_environment
from elastic_rl import jobenv
from elastic_rl.atomic import write_file_atomic
from elastic_rl.config import JobSpec
from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.launcher import engine_command
from elastic_rl.engines.router import RouterClient, router_command
from elastic_rl.errors import ElasticRLError
from elastic_rl.net import LOOPBACK, free_port, url
from elastic_rl.store import keys
from elastic_rl.store.client import Store
from policies.engine_health import judge
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
    group: str | None = None
    """Trainer ranks that live and die together: "replica-<k>" or "spare-<s>"."""


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
    trainer_groups = spec.trainer.replicas + spec.fault_tolerance.warm_spares
    return spec.engines.count + trainer_groups * spec.trainer.tensor_parallel


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
        node: str,
        lease=None,
    ):
        self.job_id = job_id
        self.node = node
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
        self._background: set[asyncio.Task] = set()
        # Engines registered with the router: only these are health-checked.
        self.serving: set[str] = set()
        self.health_failures: dict[str, int] = {}
        self._registering: dict[str, asyncio.Task] = {}

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
                    "--join_timeout_ms", str(spec.fault_tolerance.join_timeout_ms),
                ],  # fmt: skip
                shared,
                port=lighthouse_port,
            )
        ]
        for index in range(spec.engines.count):
            plans.append(self._engine_plan(index, next(devices), shared))
        groups = [("trainer", replica, {jobenv.REPLICA: str(replica)}) for replica in range(spec.trainer.replicas)]
        groups += [("spare", spare, {jobenv.SPARE: str(spare)}) for spare in range(spec.fault_tolerance.warm_spares)]
        for role, index, identity in groups:
            master_port = free_port()
            for rank in range(spec.trainer.tensor_parallel):
                device = next(devices)
                env = {
                    **shared,
                    **identity,
                    jobenv.DEVICE: str(device),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(spec.trainer.tensor_parallel),
                    "MASTER_ADDR": LOOPBACK,
                    "MASTER_PORT": str(master_port),
                }
                command = [sys.executable, "-m", "elastic_rl.trainer.main"]
                group = f"{'replica' if role == 'trainer' else 'spare'}-{index}"
                plans.append(ProcPlan(f"{role}-{index}-{rank}", role, command, env, device=device, group=group))
        plans.append(
            ProcPlan("router", "router", router_command(router_port, free_port()), shared, port=router_port)
        )
        plans.append(
            ProcPlan("orchestrator", "orchestrator", [sys.executable, "-m", "elastic_rl.rollout.orchestrator"], shared)
        )
        return plans

    @staticmethod
    def _engine_plan(index: int, device: int, shared: dict[str, str]) -> ProcPlan:
        return ProcPlan(f"engine-{index}", "engine", [], {**shared, jobenv.DEVICE: str(device)}, free_port(), device)

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
        known = {record.pid for record in self.procs.values()}
        for process in psutil.process_iter(["pid"]):
            if process.pid in known:
                continue  # a promoted warm spare keeps the name it started with
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
        if plan.role == "spare":
            jobenv.spare_assignment_path(self.workdir, plan.group).unlink(missing_ok=True)
        if plan.role in ("trainer", "spare") and not any(
            self._alive(r) for r in self._replica_ranks(record) if r is not record
        ):
            # A group starting afresh takes a new rendezvous port: the old one may have been
            # taken by another process's ephemeral port in the meantime.
            port = str(free_port())
            for rank in self._replica_ranks(record):
                rank.plan.env = {**rank.plan.env, "MASTER_PORT": port}
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
        self._in_background(self._watch_engines())

    def _in_background(self, coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _register_in_background(self, engine: str) -> None:
        """Register a (re)started engine once healthy; a registration still waiting for the
        engine's previous process is dropped."""
        previous = self._registering.pop(engine, None)
        if previous is not None:
            previous.cancel()
        self._registering[engine] = self._in_background(self._register_engines(only=engine))

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
        for record in list(self.procs.values()):
            if record.plan.role != "engine" or (only is not None and record.plan.name != only):
                continue
            engine_url = url(record.plan.port)
            await EngineClient(engine_url).wait_healthy(self.spec.engines.startup_timeout_s)
            if engine_url in await router.worker_urls():
                if only is None:
                    self.serving.add(record.plan.name)
                    continue
                await router.remove_worker(engine_url)
            await router.add_worker(engine_url)
            self.serving.add(record.plan.name)
            self.health_failures[record.plan.name] = 0
        if only is not None:
            await self.events.emit("engine_serving", "registered with the router", proc=only,
                                   device=self.procs[only].plan.device)  # fmt: skip

    async def _unregister_engine(self, record: ProcRecord) -> None:
        self.serving.discard(record.plan.name)
        try:
            await RouterClient(url(self.procs["router"].plan.port)).remove_worker(url(record.plan.port))
        except Exception as exc:  # the router may be down too; its restart registers only live engines
            log.warning("job %s: removing %s from the router failed: %s", self.job_id, record.plan.name, exc)

    async def tick(self, status: dict[str, Any] | None = None) -> None:
        """One supervision pass: notice exits, restart after backoff, scale, or settle the outcome."""
        if not await self._start_finished() or self.outcome is not None:
            return
        now = time.time()
        for record in list(self.procs.values()):
            if record.state == "running" and not self._alive(record):
                await self._on_exit(record, now)
                if self.outcome is not None:
                    return
            elif record.state == "restarting" and record.restart_at is not None and now >= record.restart_at:
                record.restarts.append(now)
                self._spawn(record)
                await self._publish(record)
                await self.events.emit("proc_restarted", f"restart {len(record.restarts)}", proc=record.plan.name,
                                       device=record.plan.device)  # fmt: skip
                if record.plan.role == "engine":
                    self._register_in_background(record.plan.name)
                elif record.plan.role == "router":
                    self.serving.clear()
                    self._in_background(self._register_engines())
        desired = (status or {}).get("engines")
        if desired is not None:
            await self._scale_engines(desired)

    async def _on_exit(self, record: ProcRecord, now: float) -> None:
        name = record.plan.name
        if record.plan.role == "orchestrator" and await self._finished():
            record.state = "exited"
            await self._publish(record)
            self.outcome = "succeeded"
            await self.events.emit("job_succeeded", "every rollout trained")
            return
        if record.plan.role in ("trainer", "spare") and record.exit_code == 0:
            # Done: every rollout trained. The orchestrator's exit settles the job.
            record.state = "exited"
            await self._publish(record)
            return
        await self.events.emit(
            "proc_exited", f"exit code {record.exit_code}; see logs/{name}.log", proc=name,
            exit_code=record.exit_code, device=record.plan.device,
        )  # fmt: skip
        if record.plan.role == "engine":
            # Out of the router at once, so no new request goes to a dead engine.
            await self._unregister_engine(record)
        if record.plan.role in ("trainer", "spare"):
            await self._stop_replica_partners(record)
        if record.plan.role == "trainer" and record.exit_code != jobenv.EXIT_ROLLBACK:
            if await self._promote_spare(record):
                return
            if record.exit_code == jobenv.EXIT_DEVICE_QUARANTINED:
                await self._move_replica(record)
                return
        if record.plan.role == "trainer" and record.exit_code == jobenv.EXIT_ROLLBACK:
            # Asked for, not a crash: restart at once from the newest snapshot.
            await self.events.emit("trainer_rollback", "restarting from the newest snapshot", proc=name)
            decision = replace(decide_restart(self.policy, record.restarts, now), delay_s=0.0)
        else:
            decision = decide_restart(self.policy, record.restarts, now)
        if not decision.restart:
            record.state = "failed"
            await self._publish(record)
            self.outcome = f"failed: {name} {decision.reason}; last exit code {record.exit_code}; see logs/{name}.log"
            await self.events.emit("job_failed", self.outcome, proc=name)
            return
        record.state = "restarting"
        record.restart_at = now + decision.delay_s
        await self._publish(record)

    def _replica_ranks(self, record: ProcRecord) -> list[ProcRecord]:
        return sorted((r for r in self.procs.values() if r.plan.group == record.plan.group), key=lambda r: r.plan.name)

    async def _promote_spare(self, record: ProcRecord) -> bool:
        """A dead replica's place goes to an idle warm spare: it only has to join the quorum and heal.

        The spare's processes become the replica's ranks (their records take the
        spare's pids and devices); a new spare starts on the dead replica's devices,
        unless they were quarantined.
        """
        spare = next(
            (r for r in self.procs.values() if r.plan.role == "spare" and r.state == "running"
             and all(p.state == "running" for p in self._replica_ranks(r))),
            None,
        )  # fmt: skip
        if spare is None:
            return False
        replica = int(record.plan.group.rsplit("-", 1)[1])
        ranks, spares = self._replica_ranks(record), self._replica_ranks(spare)
        freed = [r.plan.device for r in ranks]
        if record.exit_code == jobenv.EXIT_DEVICE_QUARANTINED:
            await mark_failed(self.store, self.node, freed, self.lease)
            await self._release_devices(freed)
        write_file_atomic(jobenv.spare_assignment_path(self.workdir, spare.plan.group), orjson.dumps({"replica": replica}))
        for rank, taker in zip(ranks, spares):
            device = taker.plan.device
            rank.plan.device = device
            rank.plan.env = {**rank.plan.env, jobenv.DEVICE: str(device), "MASTER_PORT": taker.plan.env["MASTER_PORT"]}
            rank.pid, rank.create_time, rank.state, rank.restart_at = taker.pid, taker.create_time, "running", None
            if taker.plan.name in self.children:
                self.children[rank.plan.name] = self.children.pop(taker.plan.name)
            else:
                self.children.pop(rank.plan.name, None)
            await self._publish(rank)
            taker.pid, taker.create_time = None, None
            if record.exit_code == jobenv.EXIT_DEVICE_QUARANTINED:
                taker.state = "quarantined"  # its device went with the failed replica's: no new spare
            else:
                taker.plan.device = rank_device = freed.pop(0)
                taker.plan.env = {**taker.plan.env, jobenv.DEVICE: str(rank_device)}
                taker.state, taker.restart_at = "restarting", time.time()
            await self._publish(taker)
        await self.events.emit(
            "spare_promoted", f"{spare.plan.group} takes the place of replica {replica}", proc=record.plan.name,
            device=record.plan.device,
        )  # fmt: skip
        return True

    async def _stop_replica_partners(self, record: ProcRecord) -> None:
        """The other ranks of a dead rank's replica cannot go on: kill them; they restart with it."""
        for partner in self._replica_ranks(record):
            if partner is record or partner.state != "running":
                continue
            self._signal(partner, signal.SIGKILL)
            partner.state = "restarting"
            partner.restart_at = time.time()
            await self._publish(partner)

    async def _move_replica(self, record: ProcRecord) -> None:
        """A quarantined device: mark it failed; restart the replica on free devices, or run without it."""
        ranks = self._replica_ranks(record)
        failed = sorted({r.plan.device for r in ranks if r.plan.device is not None})
        await mark_failed(self.store, self.node, failed, self.lease)
        replacements = await self._claim_devices(len(ranks), release=failed)
        if replacements is None:
            for rank in ranks:
                rank.state = "quarantined"
                await self._publish(rank)
            await self.events.emit(
                "replica_degraded", f"devices {failed} failed and no free device: the job runs on without replica "
                f"{record.plan.group}", proc=record.plan.name,
            )  # fmt: skip
            return
        for rank, device in zip(ranks, replacements):
            rank.plan.device = device
            rank.plan.env = {**rank.plan.env, jobenv.DEVICE: str(device)}
            rank.state = "restarting"
            rank.restart_at = time.time()
            await self._publish(rank)
        await self.events.emit(
            "replica_moved", f"devices {failed} failed; {record.plan.group} restarts on {replacements}",
            proc=record.plan.name,
        )  # fmt: skip

    async def _claim_devices(self, count: int, release: list[int] = ()) -> list[int] | None:
        """Take ``count`` free device slots of this node for the job (giving up ``release``)."""
        free = (await free_device_slots(self.store, await job_statuses(self.store))).get(self.node, [])
        if len(free) < count:
            return None
        claimed = free[:count]
        await self._set_devices([d for d in self.devices if d not in release] + claimed)
        return claimed

    async def _release_devices(self, released: list[int]) -> None:
        await self._set_devices([d for d in self.devices if d not in released])

    async def _set_devices(self, devices: list[int]) -> None:
        self.devices = devices
        await self.store.modify(keys.job_status(self.job_id), lambda status: {**status, "devices": devices})

    # --- engines: health and scale ----------------------------------------------------

    async def _watch_engines(self) -> None:
        """Check every serving engine (/health_generate and /health) each interval; replace the unhealthy."""
        engines = self.spec.engines
        while True:
            started = time.monotonic()
            watched = [r for r in self.procs.values() if r.plan.role == "engine" and r.plan.name in self.serving]
            clients = [EngineClient(url(r.plan.port)) for r in watched]
            generated, responsive = await asyncio.gather(
                asyncio.gather(*(c.health_generate(engines.health_timeout_s) for c in clients)),
                asyncio.gather(*(c.health(engines.health_timeout_s) for c in clients)),
            )
            for record, made, answered in zip(watched, generated, responsive):
                name = record.plan.name
                if name not in self.serving or record.state != "running":
                    continue  # replaced or gone while the check ran
                verdict = judge(made, answered, self.health_failures.get(name, 0), engines.health_failure_threshold)
                self.health_failures[name] = verdict.consecutive_failures
                if verdict.unhealthy:
                    await self._replace_engine(record, verdict.reason)
            await asyncio.sleep(max(0.0, engines.health_interval_s - (time.monotonic() - started)))

    async def _replace_engine(self, record: ProcRecord, reason: str) -> None:
        await self.events.emit("engine_unhealthy", f"{reason}; replacing it", proc=record.plan.name,
                               device=record.plan.device)  # fmt: skip
        await self._unregister_engine(record)
        self._signal(record, signal.SIGKILL)
        record.state = "restarting"
        record.restart_at = time.time()
        await self._publish(record)

    async def _scale_engines(self, desired: int) -> None:
        engines = sorted((r for r in self.procs.values() if r.plan.role == "engine"), key=lambda r: r.plan.name)
        if desired > len(engines):
            taken = {int(r.plan.name.rsplit("-", 1)[1]) for r in engines}
            claimed = await self._claim_devices(desired - len(engines))
            if claimed is None:
                return  # retried each tick until devices free up
            shared = self.procs["router"].plan.env
            index = 0
            for device in claimed:
                while index in taken:
                    index += 1
                taken.add(index)
                record = ProcRecord(self._engine_plan(index, device, shared))
                self.procs[record.plan.name] = record
                self._spawn(record)
                await self._publish(record)
                self._register_in_background(record.plan.name)
            await self.events.emit("engines_scaled", f"{len(engines)} -> {desired} engines")
        elif desired < len(engines):
            removed = engines[desired:]
            for record in removed:
                await self._unregister_engine(record)
                self._signal(record, signal.SIGTERM)
                del self.procs[record.plan.name]
                await self.store.delete(keys.proc(self.job_id, record.plan.name))
            await self._release_devices([r.plan.device for r in removed])
            await self.events.emit("engines_scaled", f"{len(engines)} -> {desired} engines")

    async def _finished(self) -> bool:
        progress = await self.store.get(keys.job_progress(self.job_id)) or {}
        return bool(progress.get("finished"))

    async def stop(self) -> None:
        for task in [self._starting, *self._background]:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
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
        self._in_background(self._register_engines())
        self._in_background(self._watch_engines())
