"""One job as one node's agent runs it: exactly the processes assigned to this node, at their generation.

Every erld is an agent. Each pass it compares the job's assignments with the
processes it runs here and acts:

- an assignment with no process yet: start it once what it needs is there
  (the job's initial weights for an engine; all its partner ranks for a
  trainer group, which start together on a fresh rendezvous port);
- a warm spare's processes the controller gave a replica's place: they are
  renamed, keep running, and learn their replica through the work dir;
- a process whose assignment moved away or to a newer generation: stopped
  (a removed engine leaves the router first);
- an exit: ``policies.exits`` decides: settle the job, restart after a
  backoff (a trainer's partner ranks with it), report a replica as displaced
  for the controller to move, or fail the job.

On a draining node (``policies.drain``) an engine whose assignment is marked
``drain`` leaves the router, finishes the requests it holds (the orchestrator
continues any it cannot finish on another engine) and stops; a process that
leaves at its safe point is reported ``drained``, never restarted. A lighthouse
whose services moved off this draining node runs on, unreported, until the
trainers have published the weights that the new lighthouse's assignment names:
they ask it for the quorums of the rollouts the old orchestrator committed.

The agent holding the job's services also exports the initial weights of a
job with no trainer (replica 0 writes them otherwise) and registers every
serving engine with the router whenever the router starts; each agent
registers and health-checks its own engines (``daemon.engines``). It reports
each process under its node lease at ``/erl/jobs/<job>/procs/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from checkpoints import layout
from daemon import engines
from daemon.draining import relieved_lighthouse_in_use
from daemon.plan import (
    ENGINE_ROLES,
    Endpoints,
    ProcSpec,
    Role,
    command,
    node_environment,
    proc_spec,
    process_env,
    server_url,
    teacher_engine_settings,
)
from daemon.pool import InterpreterPool
from daemon.proctable import LocalProc, ProcessTable, ProcState
from elastic_rl import exit_record, jobenv
from elastic_rl.atomic import write_file_atomic
from elastic_rl.engines import token_ledger
from elastic_rl.engines.client import EngineClient
from elastic_rl.errors import EngineError
from elastic_rl.event_kinds import EventKind
from elastic_rl.events import EventLog
from elastic_rl.net import url
from elastic_rl.spec.job import JobSpec
from elastic_rl.store import keys
from elastic_rl.store.client import Store
from elastic_rl.store.devices import assignment_slots, mark_failed
from elastic_rl.store.job_phase import LEAVING_PHASES, TERMINAL_PHASES, JobPhase
from policies.devices import DeviceKind
from policies.drain import engine_may_stop
from policies.engine_health import EngineLoad, EngineWatch
from policies.exits import ExitAction, ExitDecision, ExitFacts, decide_exit
from policies.lease_loss import Fate, fate
from policies.restart import RestartPolicy

log = logging.getLogger("erld.agent")

REAP_TIMEOUT_S = 5.0  # a SIGKILLed process is gone within this; one that is not is reported anyway
STOPPING_READ_TIMEOUT_S = 1.0
ENGINE_HANDOVER_S = 10.0
"""A draining engine still busy this long before its node's deadline stops anyway: the orchestrator
continues what it held on another engine in the time left."""
ENGINE_DRAIN_POLL_S = 0.5


class JobAgent:
    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        workdir: Path,
        node: str,
        advertise_host: str,
        store: Store,
        etcd_endpoint: str,
        secret: str,
        events: EventLog,
        table: ProcessTable,
        device_cooldown_s: float | None,
        device_kind: DeviceKind = DeviceKind.CPU,
        gpu_ids: tuple[str, ...] = (),
        pool: InterpreterPool | None = None,
    ):
        self.job_id, self.spec, self.workdir = job_id, spec, workdir
        self.node, self.host = node, advertise_host
        self.device_kind = device_kind  # what this node's slots are
        self.gpu_ids = gpu_ids  # on a GPU node, its GPUs' CUDA indices (daemon.gpus)
        self.pool = pool  # this node's pre-imported interpreters
        self.store, self.etcd_endpoint, self.events = store, etcd_endpoint, events
        self.secret = secret  # the job's (``elastic_rl.job_secret``): its processes get it, its engines ask it
        self.table = table
        self.device_cooldown_s = device_cooldown_s
        self.lease = None  # the node lease; set by erld, renewed on a rejoin
        self.submitted: float | None = None  # which submission of the job name this agent runs
        self.resumed: float | None = None  # and since which resume
        self.policy = RestartPolicy(spec.fault_tolerance.max_restarts, spec.fault_tolerance.restart_window_s)
        self.published: dict[str, dict[str, Any]] = {}
        self.health_watches: dict[str, EngineWatch] = {}
        self.engine_tokens: dict[str, int] = token_ledger.recorded(workdir, node)
        """Each engine process's (``<name>:<pid>``) generated tokens as last read (``token_ledger``)."""
        self._background: dict[str, asyncio.Task] = {}
        self._exporting: asyncio.Task | None = None
        self._last_health_check = 0.0

    # --- helpers -------------------------------------------------------------------

    def _in_background(self, name: str, coroutine) -> None:
        """Run ``coroutine`` in the background under ``name``; a newer task of that name replaces it.
        A failure is logged: the next pass acts on what it finds then."""
        previous = self._background.pop(name, None)
        if previous is not None:
            previous.cancel()

        async def logged() -> None:
            try:
                await coroutine
            except Exception:
                log.exception("job %s: %s (in the background) failed", self.job_id, name)

        task = asyncio.create_task(logged())
        self._background[name] = task
        task.add_done_callback(lambda t: self._background.pop(name, None) if self._background.get(name) is t else None)

    def _base_env(self) -> dict[str, str]:
        """What every process of the job gets; a process without a slot (the services, the initial
        export) sees no GPU."""
        return {
            **node_environment(),
            jobenv.JOB: self.job_id,
            jobenv.WORKDIR: str(self.workdir),
            jobenv.ETCD: self.etcd_endpoint,
            jobenv.SECRET: self.secret,
        }

    @staticmethod
    def _endpoints(assigned: dict[str, dict]) -> Endpoints | None:
        if "router" not in assigned or "lighthouse" not in assigned:
            return None
        return Endpoints(router=server_url(assigned["router"]), lighthouse=server_url(assigned["lighthouse"]))

    async def _publish(self, proc: LocalProc) -> None:
        spec = proc_spec(proc.name)
        record = {
            "node": self.node,
            "role": spec.role.value,
            "state": proc.state.value,
            "pid": proc.pid,
            "port": proc.port,
            "device": proc.device,
            "generation": proc.generation,
            "restarts": len(proc.restarts),
            "exit_code": proc.exit_code,
            "serving": proc.serving,
            "url": url(proc.port, host=self.host) if proc.port is not None else None,
        }
        if self.published.get(proc.name) != record:
            await self.store.put(keys.proc(self.job_id, proc.name), record, lease=self.lease)
            self.published[proc.name] = record

    async def _set_phase(self, phase: JobPhase, reason: str) -> None:
        ended = {"phase": phase, "reason": reason, "ended": time.time()}
        await self.store.modify(
            keys.job_status(self.job_id),
            lambda status: {**status, **ended} if status.get("phase") not in TERMINAL_PHASES else status,
        )

    # --- one pass --------------------------------------------------------------------

    async def tick(
        self, status: dict[str, Any], assigned: dict[str, dict], reported: dict[str, dict], failed: set[int]
    ) -> None:
        """One supervision pass; ``assigned``: every assignment of the job; ``reported``: every
        process record of the job in etcd (other nodes' too); ``failed``: this node's failed slots."""
        if status["phase"] in (*LEAVING_PHASES, JobPhase.PAUSED, *TERMINAL_PHASES):
            # A pausing job stops as a stopped one does (trainers finish the rollout in hand and snapshot).
            await self.stop(graceful=status["phase"] in LEAVING_PHASES)
            return
        mine = {name: a for name, a in assigned.items() if a["node"] == self.node}
        await self._take_promotions(mine)
        await self._drop_unassigned(mine, assigned)
        await self._drain_engines(mine, assigned)
        now = time.time()
        for proc in self.table.of_job(self.job_id):
            if proc.state is ProcState.RUNNING and not self.table.alive(proc):
                await self._on_exit(proc, assigned, reported, now)
                if status.get("phase") != JobPhase.RUNNING or await self._job_over():
                    return
        await self._start_assigned(mine, assigned, failed)
        await self._check_export()
        await self._check_engines(now, assigned)
        for proc in self.table.of_job(self.job_id):
            if assigned.get(proc.name, {}).get("node", self.node) == self.node:  # not one relieved elsewhere
                await self._publish(proc)

    async def _job_over(self) -> bool:
        status = await self.store.get(keys.job_status(self.job_id)) or {}
        return status.get("phase") in TERMINAL_PHASES

    async def _take_promotions(self, mine: dict[str, dict]) -> None:
        """Warm spares the controller gave a replica's place: rename them, tell them which replica."""
        promoted: dict[str, tuple[int, int]] = {}
        for name, assignment in sorted(mine.items()):
            spare_name = assignment.get("adopt")
            spare = self.table.get(self.job_id, spare_name) if spare_name else None
            if spare is None:
                continue
            predecessor = self.table.get(self.job_id, name)
            if predecessor is not None:
                if predecessor.generation >= assignment["generation"]:
                    continue  # taken over already
                self.table.signal(predecessor, signal.SIGKILL)  # the displaced replica this spare replaces
                self.table.forget(predecessor)
            old_generation = spare.generation
            self.table.rename(spare, name, assignment["generation"])
            self.published.pop(spare_name, None)
            spare_group = proc_spec(spare_name).group
            promoted[f"{spare_group}-{old_generation}"] = (proc_spec(name).group_index, assignment["generation"])
        for token, (replica, generation) in promoted.items():
            write_file_atomic(
                layout.spare_assignment_path(self.workdir, token),
                orjson.dumps({"replica": replica, "generation": generation}),
            )

    async def _drop_unassigned(self, mine: dict[str, dict], assigned: dict[str, dict]) -> None:
        """Stop the processes whose assignment left this node or moved to a newer generation."""
        for proc in self.table.of_job(self.job_id):
            assignment = mine.get(proc.name)
            if fate(self.node, proc.generation, assignment) is Fate.KEEP:
                continue
            if self._lighthouse_still_needed(proc, assigned):
                continue
            spec = proc_spec(proc.name)
            if spec.role is Role.ENGINE and proc.serving and "router" in assigned:
                await engines.unregister(server_url(assigned["router"]), url(proc.port, host=self.host), self.secret)
            # An engine scaled away may finish what it holds; anything else is replaced at once.
            self.table.signal(
                proc, signal.SIGTERM if spec.role is Role.ENGINE and assignment is None else signal.SIGKILL
            )
            self.table.forget(proc)
            self.published.pop(proc.name, None)
            await self.store.delete(keys.proc(self.job_id, proc.name))

    def _lighthouse_still_needed(self, proc: LocalProc, assigned: dict[str, dict]) -> bool:
        """A lighthouse relieved by one elsewhere (the services left this draining node after the
        orchestrator's commit) runs on while the trainers train what that orchestrator committed: they ask
        it for those steps' quorums, and switch to the new one at the next rollout."""
        relieves = assigned.get(proc.name, {}).get("relieves")
        if proc_spec(proc.name).role is not Role.LIGHTHOUSE or relieves is None or relieves["node"] != self.node:
            return False
        no_trainer = self.spec.trainer_groups[0] == 0
        return self.table.alive(proc) and not no_trainer and relieved_lighthouse_in_use(self.workdir, relieves)

    async def _drain_engines(self, mine: dict[str, dict], assigned: dict[str, dict]) -> None:
        """Engines asked to leave this draining node: out of the router now, stopped once their requests
        are done or the deadline nears (``policies.drain.engine_may_stop``)."""
        for name, assignment in mine.items():
            proc = self.table.get(self.job_id, name)
            if "drain" not in assignment or proc is None or proc.draining or proc.state is not ProcState.RUNNING:
                continue
            role = proc_spec(name).role
            if role not in ENGINE_ROLES:
                continue
            proc.draining = True
            if role is Role.ENGINE and proc.serving and "router" in assigned:
                await engines.unregister(server_url(assigned["router"]), url(proc.port, host=self.host), self.secret)
            proc.serving = False
            self.health_watches.pop(name, None)
            self._in_background(name, self._stop_when_idle(proc, assignment["drain"]))
            await self.events.emit(
                EventKind.ENGINE_DRAINING, "out of the router; finishing its requests", proc=name, device=proc.device
            )

    async def _stop_when_idle(self, proc: LocalProc, deadline: float) -> None:
        engine = EngineClient(url(proc.port, host=self.host), secret=self.secret)
        while True:
            load = await engine.load(self.spec.engines.health_timeout_s)
            if engine_may_stop(load and load.holding_work, time.time(), deadline, ENGINE_HANDOVER_S):
                break
            await asyncio.sleep(ENGINE_DRAIN_POLL_S)
        self._record_engine_tokens({proc.name: load})
        self.table.signal(proc, signal.SIGKILL)

    # --- exits --------------------------------------------------------------------------

    def _partners(self, proc: LocalProc) -> list[LocalProc]:
        group = proc_spec(proc.name).group
        return [p for p in self.table.of_job(self.job_id) if proc_spec(p.name).group == group and p is not proc]

    async def _on_exit(self, proc: LocalProc, assigned: dict, reported: dict, now: float) -> None:
        spec = proc_spec(proc.name)
        if proc.draining:
            proc.state = ProcState.DRAINED  # an engine that left its draining node: the controller moves it
            return
        if proc.exit_code is None and proc.pid is not None:
            # Adopted from an earlier erld, so not this one's child: the code the trainer recorded, if any.
            proc.exit_code = exit_record.read(self.workdir, proc.pid, proc.create_time)
        progress = await self.store.get(keys.job_progress(self.job_id)) or {}
        idle_spare = any(
            record.get("role") == "spare" and record.get("state") == "running"
            for name, record in reported.items()
            if not any(a.get("adopt") == name for a in assigned.values())
        )
        facts = ExitFacts(
            role=spec.role.value,
            exit_code=proc.exit_code,
            job_finished=bool(progress.get("finished")),
            idle_spare=idle_spare,
            restarts=tuple(proc.restarts),
            now=now,
            given_up=progress.get("failure", ""),
            other_engines=self._other_engines(proc.name, reported),
            asked_to_leave=bool(assigned.get(proc.name, {}).get("drain")),
        )
        decision = decide_exit(facts, self.policy)
        if decision.action is ExitAction.SUCCEED_JOB:
            proc.state = ProcState.EXITED
            await self._publish(proc)
            await self._set_phase(JobPhase.SUCCEEDED, "")
            await self.events.emit(EventKind.JOB_SUCCEEDED, decision.reason)
            return
        if decision.action is ExitAction.DRAINED:
            proc.state = ProcState.DRAINED  # left at its safe point: the controller moves it
            return
        if decision.action is ExitAction.DONE:
            proc.state = ProcState.EXITED
            return
        await self.events.emit(
            EventKind.PROC_EXITED,
            f"exit code {proc.exit_code}; see logs/{proc.name}.log",
            proc=proc.name,
            exit_code=proc.exit_code,
            device=proc.device,
        )
        if spec.role in ENGINE_ROLES and proc.serving:
            # Out of the router and etcd's list of serving engines at once, so no new request goes to a dead engine.
            proc.serving = False
            if spec.role is Role.ENGINE and "router" in assigned:
                await engines.unregister(server_url(assigned["router"]), url(proc.port, host=self.host), self.secret)
        group = [proc, *self._partners(proc)] if spec.role in (Role.TRAINER, Role.SPARE) else [proc]
        for partner in group[1:]:
            # The other ranks of a dead rank's replica are stuck in their collectives.
            self.table.signal(partner, signal.SIGKILL)
        await self._carry_out(proc, decision, group, now)

    @staticmethod
    def _other_engines(name: str, reported: dict[str, dict]) -> int:
        """The job's engines of ``name``'s kind (the policy's, or a teacher's) running besides it, on any node
        (``reported``: name -> record)."""
        role = proc_spec(name).role.value
        return sum(
            1
            for other, record in reported.items()
            if other != name and record.get("role") == role and record.get("state") == "running"
        )

    async def _carry_out(self, proc: LocalProc, decision: ExitDecision, group: list[LocalProc], now: float) -> None:
        """What an exit's decision asks of ``proc`` (and the rest of its trainer ``group``), once it is dead."""
        if decision.action is ExitAction.FAIL_JOB:
            proc.state = ProcState.FAILED
            reason = f"{proc.name} {decision.reason}; last exit code {proc.exit_code}; see logs/{proc.name}.log"
            await self._publish(proc)
            await self._set_phase(JobPhase.FAILED, reason)
            await self.events.emit(EventKind.JOB_FAILED, reason, proc=proc.name)
            return
        if decision.action is ExitAction.GIVE_UP_ENGINE:
            proc.state = ProcState.FAILED
            reason = f"{proc.name} given up: {decision.reason}"
            await self._publish(proc)
            await self.store.modify(
                keys.job_status(self.job_id),
                lambda status: {**status, "degraded": [*status.get("degraded", []), reason]},
            )
            await self.events.emit(EventKind.ENGINE_GIVEN_UP, decision.reason, proc=proc.name, device=proc.device)
            return
        if decision.action is ExitAction.MOVE_REPLICA:
            if decision.quarantine_device:
                devices = [p.device for p in group if p.device is not None]
                await mark_failed(
                    self.store, self.node, devices, f"{proc.name}: {decision.reason}", self.device_cooldown_s
                )
            for member in group:
                member.state = ProcState.DISPLACED
            return
        if decision.rollback:
            await self.events.emit(EventKind.TRAINER_ROLLBACK, decision.reason, proc=proc.name)
        for member in group:
            member.state, member.restart_at = ProcState.RESTARTING, now + decision.delay_s
        proc.restarts.append(now)

    # --- starting -----------------------------------------------------------------------

    async def _start_assigned(self, mine: dict[str, dict], assigned: dict[str, dict], failed: set[int]) -> None:
        endpoints = self._endpoints(assigned)
        if endpoints is None:
            return
        now = time.time()
        groups: dict[str, list[tuple[ProcSpec, dict]]] = {}
        for name, assignment in sorted(mine.items()):
            groups.setdefault(proc_spec(name).group, []).append((proc_spec(name), assignment))
        for group, members in groups.items():
            procs = []
            for spec, assignment in members:
                proc = self.table.get(self.job_id, spec.name) or self.table.add(
                    LocalProc(
                        self.job_id,
                        spec.name,
                        assignment["generation"],
                        assignment.get("device"),
                        assignment.get("port"),
                    )
                )
                procs.append(proc)
            due = [
                p
                for p in procs
                if p.state is ProcState.WAITING or (p.state is ProcState.RESTARTING and now >= (p.restart_at or 0))
            ]
            if any(set(assignment_slots(assignment)) & failed for _, assignment in members):
                continue  # not on a failed device: the controller is moving the group
            if not due or not await self._ready(members[0][0]):
                continue
            if members[0][0].role in (Role.TRAINER, Role.SPARE):
                if len(procs) < self.spec.trainer.ranks_per_replica:
                    continue  # a rank is not assigned here yet
                for partner in (p for p in procs if p.state is ProcState.RUNNING):
                    # A group starts whole (a rank died while erld was down, say): its live ranks go too.
                    self.table.signal(partner, signal.SIGKILL)
                    partner.state, partner.restart_at = ProcState.RESTARTING, now
                # A group starting afresh meets at a new place (its rank 0 opens a store there).
                rendezvous = {jobenv.RENDEZVOUS: str(layout.rendezvous_path(self.workdir, group, time.time_ns()))}
            else:
                rendezvous = {}
            for proc, (spec, assignment) in zip(procs, members):
                if proc not in due and proc.state is not ProcState.RESTARTING:
                    continue
                await self._spawn(proc, spec, assignment, endpoints, rendezvous)

    async def _ready(self, spec: ProcSpec) -> bool:
        """Whether a group may start: an engine needs the job's initial weights, which replica 0 of
        the trainers writes once it has built the model; for a job with no trainer
        (debug.rollout_only) the services' agent exports them (in the background) when it starts
        them. A cpu engine starts at once and waits for them itself, so its imports overlap."""
        have_weights = layout.latest_weights_version(self.workdir) is not None
        no_trainer = self.spec.trainer_groups[0] == 0
        if spec.role is Role.LIGHTHOUSE and no_trainer and not have_weights and self._exporting is None:
            self._exporting = asyncio.create_task(self._export_initial_weights())
        # A teacher engine serves its own checkpoint, there from the start.
        return have_weights or spec.role is not Role.ENGINE or self.spec.engines.kind == "cpu"

    async def _check_export(self) -> None:
        """A failed export of the initial weights fails the job: no engine could start."""
        if self._exporting is None or not self._exporting.done():
            return
        error, self._exporting = self._exporting.exception(), None
        if error is not None:
            await self._set_phase(JobPhase.FAILED, str(error))
            await self.events.emit(EventKind.JOB_FAILED, str(error))

    async def _export_initial_weights(self) -> None:
        log_path = layout.proc_log_path(self.workdir, "init-weights")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "elastic_rl.model.export",
                str(layout.spec_path(self.workdir)),
                str(layout.weights_dir(self.workdir, 0)),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self._base_env(),
            )
            code = await process.wait()
        if code != 0:
            raise RuntimeError(f"exporting the initial weights failed (exit {code}); see {log_path}")

    async def _spawn(
        self, proc: LocalProc, spec: ProcSpec, assignment: dict, endpoints: Endpoints, extra: dict
    ) -> None:
        restarted = proc.state is ProcState.RESTARTING
        env = process_env(
            spec, assignment, endpoints, self._base_env(), self.host, self.spec, self.device_kind, self.gpu_ids
        )
        env.update(extra)
        started = command(spec, assignment, self.spec, self.workdir, self.host)
        from_pool = self.table.spawn(proc, started, env, self.workdir, self.pool)
        await self._publish(proc)
        how = "from a pre-imported interpreter" if from_pool else "cold"
        if restarted:
            await self.events.emit(
                EventKind.PROC_RESTARTED,
                f"restart {len(proc.restarts)}, {how}",
                proc=proc.name,
                device=proc.device,
                from_pool=from_pool,
            )
        elif not assignment.get("initial"):
            # Placed after the job started: a new spare, a moved group, an added engine.
            await self.events.emit(
                EventKind.PROC_STARTED,
                f"on node {self.node}, {how}",
                proc=proc.name,
                device=proc.device,
                from_pool=from_pool,
            )
        # A replaced, moved or added engine is news; the job's first engines are not.
        announce = restarted or not assignment.get("initial")
        if spec.role is Role.ENGINE:
            self._in_background(proc.name, self._register_engine(proc, endpoints.router, announce))
        elif spec.role is Role.TEACHER:
            self._in_background(proc.name, self._serve_teacher(proc, announce))
        elif spec.role is Role.ROUTER:
            self._in_background(proc.name, self._register_every_engine(endpoints.router))

    async def _register_engine(self, proc: LocalProc, router_url: str, announce: bool) -> None:
        engine_url = url(proc.port, host=self.host)
        client = EngineClient(engine_url, secret=self.secret)
        try:
            await client.wait_healthy(self.spec.engines.startup_timeout_s)
        except EngineError as exc:
            await self._replace_engine(proc, f"it did not start: {exc}")
            return
        # Newer weights may have come while it started: it serves no stale version.
        version = layout.latest_weights_version(self.workdir)
        if version is not None and str(version) != (await client.model_info())["weight_version"]:
            await client.update_weights_from_disk(str(layout.weights_dir(self.workdir, version)), str(version))
        await engines.register(router_url, engine_url, self.spec.engines.startup_timeout_s, self.secret)
        await self._serving(proc, "registered with the router" if announce else None)

    async def _serve_teacher(self, proc: LocalProc, announce: bool) -> None:
        """A teacher engine serves once it answers: it is in no router (the orchestrator reaches the teacher
        engines through their records in etcd), and health-checked as the policy's engines are."""
        teacher = teacher_engine_settings(self.spec)
        try:
            await EngineClient(url(proc.port, host=self.host), secret=self.secret).wait_healthy(
                teacher.startup_timeout_s
            )
        except EngineError as exc:
            await self._replace_engine(proc, f"it did not start: {exc}")
            return
        await self._serving(proc, "a teacher engine, serving" if announce else None)

    async def _serving(self, proc: LocalProc, news: str | None) -> None:
        """An engine serves from now on: health-checked, recorded as serving (where the orchestrator's direct
        requests look), and with ``news``, announced."""
        proc.serving = True
        self.health_watches[proc.name] = EngineWatch(time.time())
        await self._publish(proc)
        if news is not None:
            await self.events.emit(EventKind.ENGINE_SERVING, news, proc=proc.name, device=proc.device)

    async def _register_every_engine(self, router_url: str) -> None:
        reported = await self.store.get_prefix(keys.procs(self.job_id))
        serving = [
            record["url"] for record in reported.values() if record.get("role") == "engine" and record.get("serving")
        ]
        await engines.register_all(router_url, serving, self.secret)

    # --- engine health ------------------------------------------------------------------

    async def _check_engines(self, now: float, assigned: dict[str, dict]) -> None:
        """Each interval, in the background: check this node's serving engines and replace the
        unhealthy; where the router runs here, take out of it the addresses no engine has any more."""
        if now - self._last_health_check < self.spec.engines.health_interval_s or "health" in self._background:
            return
        self._last_health_check = now
        serving = {
            p.name: url(p.port, host=self.host)
            for p in self.table.of_job(self.job_id)
            if p.serving and p.state is ProcState.RUNNING
        }
        if serving:
            self._in_background("health", self._health_pass(serving))
        if self.spec.colocated and "hung" not in self._background:
            self._in_background("hung", self._replace_reported_hung(assigned))
        router = assigned.get("router")
        if router is not None and router["node"] == self.node and "prune" not in self._background:
            engine_urls = {server_url(a) for name, a in assigned.items() if proc_spec(name).role is Role.ENGINE}
            self._in_background("prune", engines.prune(server_url(router), engine_urls, self.secret))

    async def _health_pass(self, serving: dict[str, str]) -> None:
        read = await engines.loads(serving, self.spec.engines.health_timeout_s)
        self._record_engine_tokens(read)
        verdicts = engines.judged(read, self.health_watches, self.spec.engines.hang_timeout_s)
        assigned = {
            keys.last_part(k): v for k, v in (await self.store.get_prefix(keys.assignments(self.job_id))).items()
        }
        for name, verdict in verdicts.items():
            proc = self.table.get(self.job_id, name)
            if not verdict.unhealthy or proc is None or not proc.serving or proc.state is not ProcState.RUNNING:
                continue  # healthy, or replaced or gone while the check ran
            if proc_spec(name).role is Role.ENGINE and "router" in assigned:
                await engines.unregister(server_url(assigned["router"]), serving[name], self.secret)
            await self._replace_engine(proc, verdict.reason)

    async def _replace_reported_hung(self, assigned: dict[str, dict]) -> None:
        """Colocated: replace this node's engines the orchestrator reported hung in a handover (one that did not
        release or resume its memory in time); a report of an engine already gone is dropped."""
        for key, report in (await self.store.get_prefix(keys.hung_reports(self.job_id))).items():
            proc = self.table.get(self.job_id, keys.last_part(key))
            if proc is None:
                continue  # another node's engine: its agent acts on it
            if proc.pid == report.get("pid") and proc.state is ProcState.RUNNING:
                if proc.serving and "router" in assigned:
                    await engines.unregister(
                        server_url(assigned["router"]), url(proc.port, host=self.host), self.secret
                    )
                await self._replace_engine(proc, report.get("reason", "hung in a handover"))
            await self.store.delete(key)

    async def _replace_engine(self, proc: LocalProc, reason: str) -> None:
        """An engine that is hung or did not start: killed, then dealt with as any exit of it is (restarted
        after the restart policy's backoff, given up once its budget is spent)."""
        await self.events.emit(
            EventKind.ENGINE_UNHEALTHY, f"{reason}; replacing it", proc=proc.name, device=proc.device
        )
        records = await self.store.get_prefix(keys.procs(self.job_id))
        others = self._other_engines(proc.name, {keys.last_part(key): record for key, record in records.items()})
        # No await from the kill to the new state: the supervision pass must not take it for an exit too.
        proc.serving = False
        self.table.signal(proc, signal.SIGKILL)
        now = time.time()
        facts = ExitFacts(
            role=proc_spec(proc.name).role.value,
            exit_code=None,
            job_finished=False,
            idle_spare=False,
            restarts=tuple(proc.restarts),
            now=now,
            other_engines=others,
        )
        await self._carry_out(proc, decide_exit(facts, self.policy), [proc], now)
        await self._publish(proc)

    def _record_engine_tokens(self, read: dict[str, EngineLoad | None]) -> None:
        """Keep each engine process's newest generated-token count in the work dir (``token_ledger``)."""
        changed = False
        for name, load in read.items():
            proc = self.table.get(self.job_id, name)
            if load is None or proc is None:
                continue
            entry = f"{name}:{proc.pid}"
            if self.engine_tokens.get(entry) != load.generated_tokens:
                self.engine_tokens[entry], changed = load.generated_tokens, True
        if changed:
            token_ledger.record(self.workdir, self.node, self.engine_tokens)

    # --- stopping ------------------------------------------------------------------------

    async def stop(self, graceful: bool) -> None:
        """Stop every process of the job here: SIGTERM and a grace period (trainers snapshot), then SIGKILL."""
        for task in list(self._background.values()):
            task.cancel()
        procs = [p for p in self.table.of_job(self.job_id) if p.state is not ProcState.STOPPED]
        if not procs:
            return
        try:
            await self._stop(procs, graceful)
        finally:
            if self.spec.engines.weight_sync == "memory":  # the copies the trainers here made, with them gone
                shutil.rmtree(layout.memory_weights_root(self.workdir), ignore_errors=True)
                with contextlib.suppress(OSError):  # and the common folder, unless another job's are in it
                    layout.SHARED_MEMORY.rmdir()

    async def _stop(self, procs: list[LocalProc], graceful: bool) -> None:
        serving = {p.name: url(p.port, host=self.host) for p in procs if p.serving and self.table.alive(p)}
        if serving:  # the engines' last count of the tokens they generated, before they go
            self._record_engine_tokens(await engines.loads(serving, STOPPING_READ_TIMEOUT_S))
        if graceful:
            # The lighthouse goes last: a trainer finishing its rollout still needs its quorum, and one
            # whose lighthouse is gone retries it until the grace runs out and it is killed unsaved.
            deadline = time.monotonic() + self.spec.fault_tolerance.stop_grace_s
            last = [p for p in procs if proc_spec(p.name).role is Role.LIGHTHOUSE]
            for wave in ([p for p in procs if p not in last], last):
                for proc in wave:
                    self.table.signal(proc, signal.SIGTERM)
                while time.monotonic() < deadline and any(self.table.alive(p) for p in wave):
                    await asyncio.sleep(0.1)
        for proc in procs:
            self.table.signal(proc, signal.SIGKILL)
        # Reaped before they are reported stopped: a stopped job leaves no process, not even a zombie.
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while time.monotonic() < deadline and any(self.table.alive(p) for p in procs):
            await asyncio.sleep(0.05)
        for proc in procs:
            if proc.state in (ProcState.RUNNING, ProcState.RESTARTING, ProcState.WAITING, ProcState.DISPLACED):
                proc.state = ProcState.STOPPED
            await self._publish(proc)
