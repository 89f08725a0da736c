"""The job processes one erld runs: start, watch, signal, and the record that lets a restarted erld adopt them.

Each process runs in its own session with its output appended to
``workdir/logs/<proc>.log``, so it outlives a crash of erld; a pooled
interpreter (``daemon.pool``) that becomes one is such a process from its
start, and is watched and signalled as any other. The table is
saved to the erld's state file after every pass, and a restarted erld adopts
the processes still alive (same pid, same start time) and forgets the rest.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import orjson
import psutil

from checkpoints import layout
from daemon.pool import InterpreterPool
from elastic_rl import jobenv


class ProcState(Enum):
    WAITING = "waiting"
    """Assigned here; waiting for what it needs (initial weights, its partners)."""
    RUNNING = "running"
    RESTARTING = "restarting"
    """Exited; starts again at ``restart_at``."""
    DISPLACED = "displaced"
    """A trainer replica whose place goes elsewhere (a warm spare, or free devices): the controller moves it."""
    DRAINED = "drained"
    """Left its draining node at a safe point (``policies.drain``): the controller places it elsewhere."""
    EXITED = "exited"
    """Finished its work."""
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class LocalProc:
    job: str
    name: str
    generation: int
    device: int | None = None
    port: int | None = None
    pid: int | None = None
    create_time: float | None = None
    restarts: list[float] = field(default_factory=list)
    state: ProcState = ProcState.WAITING
    restart_at: float | None = None
    exit_code: int | None = None
    serving: bool = False
    """An engine registered with the router (only those are health-checked)."""
    draining: bool = False
    """An engine taken out of the router because its node drains: it finishes its requests, then stops."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LocalProc:
        return cls(**{**raw, "state": ProcState(raw["state"])})


class ProcessTable:
    def __init__(self, node: str, etcd_endpoint: str):
        self.node = node
        self.etcd_endpoint = etcd_endpoint
        """The cluster's etcd: with the node's name, what tells this erld's processes apart from those of
        another cluster's erld on the same host (its node may have the same name, its job too)."""
        self.procs: dict[tuple[str, str], LocalProc] = {}
        self.children: dict[tuple[str, str], subprocess.Popen] = {}
        self.forgotten: list[subprocess.Popen] = []
        """Children dropped from the table while they may still run: reaped once they end (``reap``)."""

    def get(self, job: str, name: str) -> LocalProc | None:
        return self.procs.get((job, name))

    def of_job(self, job: str) -> list[LocalProc]:
        return sorted((p for (j, _), p in self.procs.items() if j == job), key=lambda p: p.name)

    def add(self, proc: LocalProc) -> LocalProc:
        self.procs[(proc.job, proc.name)] = proc
        return proc

    def forget(self, proc: LocalProc) -> None:
        """Drop a process from the table (signal it first if it must end)."""
        self.procs.pop((proc.job, proc.name), None)
        child = self.children.pop((proc.job, proc.name), None)
        if child is not None:
            self.forgotten.append(child)
        self.reap()

    def reap(self) -> None:
        """Collect the exit of every forgotten child that has ended, so that none stays a zombie."""
        self.forgotten = [child for child in self.forgotten if child.poll() is None]

    def rename(self, proc: LocalProc, name: str, generation: int) -> LocalProc:
        """A warm spare's process becomes a replica's: same pid, new name and generation."""
        key = (proc.job, proc.name)
        self.procs.pop(key)
        child = self.children.pop(key, None)
        proc.name, proc.generation = name, generation
        self.procs[(proc.job, name)] = proc
        if child is not None:
            self.children[(proc.job, name)] = child
        return proc

    def spawn(
        self,
        proc: LocalProc,
        command: list[str],
        env: dict[str, str],
        workdir: Path,
        pool: InterpreterPool | None = None,
    ) -> bool:
        """Start ``proc``: a pooled interpreter of its kind becomes it where one is idle, else a new
        process runs ``command``. Returns whether it came from the pool."""
        self.kill_strays(proc)
        log_path = layout.proc_log_path(workdir, proc.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**env, jobenv.NODE: self.node}
        taken = pool.take(command) if pool is not None else None
        child = self._assign(taken, env, log_path) if taken is not None else None
        if child is None:
            with open(log_path, "ab") as log_file:
                child = subprocess.Popen(
                    command,
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd=os.getcwd(),
                )
        self.children[(proc.job, proc.name)] = child
        proc.pid, proc.create_time = child.pid, psutil.Process(child.pid).create_time()
        proc.state, proc.restart_at, proc.exit_code, proc.serving = ProcState.RUNNING, None, None, False
        return taken is not None and child is taken[0]

    @staticmethod
    def _assign(
        taken: tuple[subprocess.Popen, list[str]], env: dict[str, str], log_path: Path
    ) -> subprocess.Popen | None:
        """Hand a pooled interpreter its assignment; None if it died before it could take it."""
        interpreter, argv = taken
        assignment = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log_path)}
        try:
            interpreter.stdin.write(orjson.dumps(assignment) + b"\n")
            interpreter.stdin.close()
        except (BrokenPipeError, ValueError):
            return None
        return interpreter

    def alive(self, proc: LocalProc) -> bool:
        child = self.children.get((proc.job, proc.name))
        if child is not None and child.pid == proc.pid:
            if child.poll() is None:
                return True
            proc.exit_code = child.returncode
            return False
        if proc.pid is None:
            return False
        try:
            process = psutil.Process(proc.pid)
            return process.create_time() == proc.create_time and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def signal(self, proc: LocalProc, sig: int) -> None:
        if proc.pid is not None and self.alive(proc):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill_strays(self, proc: LocalProc) -> None:
        """Kill processes of this job and name, started for this node of this cluster, that no record knows.

        An erld killed between starting a process and saving its state leaves such an
        orphan behind; it would hold the port its replacement needs.
        """
        known = {p.pid for p in self.procs.values()}
        for process in psutil.process_iter(["pid"]):
            if process.pid in known:
                continue  # a promoted warm spare keeps the name it started with
            try:
                environ = process.environ()
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            if (
                environ.get(jobenv.JOB) == proc.job
                and environ.get(jobenv.PROC) == proc.name
                and environ.get(jobenv.NODE) == self.node
                and environ.get(jobenv.ETCD) == self.etcd_endpoint
            ):
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def kill_all(self) -> None:
        """SIGKILL every process of the table at once (fencing: this erld lost its node)."""
        for proc in self.procs.values():
            self.signal(proc, signal.SIGKILL)
        for child in self.children.values():
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        self.children.clear()

    # --- the state file ------------------------------------------------------

    def to_state(self) -> list[dict[str, Any]]:
        return [proc.to_json() for proc in self.procs.values()]

    def adopt(self, saved: list[dict[str, Any]]) -> list[LocalProc]:
        """Take over a previous erld's processes that still run; return them."""
        adopted = []
        for raw in saved:
            proc = LocalProc.from_json(raw)
            if proc.state is ProcState.RUNNING and self.alive(proc):
                adopted.append(self.add(proc))
        return adopted
