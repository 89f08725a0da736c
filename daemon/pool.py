"""Pre-imported interpreters on one node, so that starting a job process costs a fork, not an import.

For each pooled kind erld keeps up to its size of idle interpreters
(``elastic_rl.warm_interpreter``) that have imported what that kind runs:

    trainer        elastic_rl.trainer.main             (trainer ranks and warm spares)
    orchestrator   elastic_rl.rollout.orchestrator
    engine         elastic_rl.engines.cpu_server        (cpu engines; SGLang starts its own)

A process due to start whose command runs one of these modules takes the
oldest idle interpreter of its kind (``take``); ``fill`` starts replacements
in the background on the next pass. The pool costs host memory, not device
slots: an idle interpreter holds about what the process would after its
imports (a trainer's about 430 MB here). Nor does it take CPU from the job:
an interpreter imports at the lowest priority (nice 19, ``elastic_rl.priority``),
so a pool refilled in the middle of a run uses only what the job's processes
leave, and the one taken is raised back to normal as it is handed out. Pool
interpreters carry
``ERL_POOL_NODE`` in their environment: an erld that starts ends every one of
its node's that is not a process it adopted (its predecessor's idle ones, or
one assigned just before that erld died, before it saved its state).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import psutil

from elastic_rl import jobenv
from elastic_rl.priority import normal_priority
from elastic_rl.warm_interpreter import READY

log = logging.getLogger("erld.pool")

POOL_NODE = "ERL_POOL_NODE"
MODULES = {
    "trainer": "elastic_rl.trainer.main",
    "orchestrator": "elastic_rl.rollout.orchestrator",
    "engine": "elastic_rl.engines.cpu_server",
}
DEFAULT_SIZES = {"trainer": 2, "orchestrator": 1, "engine": 1}
"""Fits a GPU node: two trainer ranks (a replica at TP=2, or two replicas' rank) restart from the pool
at once, and an orchestrator and an engine each; about 1.6 GB of host memory."""


@dataclass
class Idle:
    kind: str
    process: subprocess.Popen
    said: bytes = b""
    """What it has written to its stdout (a pipe, read without blocking): READY once its imports are done."""

    @property
    def ready(self) -> bool:
        if READY.encode() not in self.said and self.process.stdout is not None:
            try:
                self.said += os.read(self.process.stdout.fileno(), 4096)
            except (BlockingIOError, OSError):
                pass
        return READY.encode() in self.said


class InterpreterPool:
    def __init__(
        self, node: str, sizes: dict[str, int], log_dir: Path, environment: dict[str, str], etcd_endpoint: str
    ):
        self.node = node
        self.sizes = {kind: n for kind, n in sizes.items() if n > 0}
        self.log_dir = log_dir
        # The etcd goes into every interpreter's environment: its /proc environ stays the pool's after it
        # becomes a job process, and the node's name with the etcd tells this cluster's interpreters apart
        # from another cluster's on the same host (``end_leftovers``, and the chaos harness's node deaths).
        self.etcd_endpoint = etcd_endpoint
        self.environment = {**environment, jobenv.ETCD: etcd_endpoint}
        """What every interpreter starts with; the assigned process's own replaces it."""
        self.idle: dict[str, deque[Idle]] = {kind: deque() for kind in self.sizes}

    def fill(self) -> None:
        """Start interpreters until each kind has its size of live idle ones."""
        for kind, size in self.sizes.items():
            idle = self.idle[kind]
            for gone in [entry for entry in idle if entry.process.poll() is not None]:
                log.warning("a pooled %s interpreter exited (code %s); starting another", kind, gone.process.returncode)
                idle.remove(gone)
            while len(idle) < size:
                idle.append(Idle(kind, self._start(kind)))

    def _start(self, kind: str) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"pool-{self.node}-{kind}.log", "ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "elastic_rl.warm_interpreter", MODULES[kind]],
                env={**self.environment, POOL_NODE: self.node},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,
            )
        os.set_blocking(process.stdout.fileno(), False)
        return process

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per pooled kind: idle interpreters ready (imports done) and still importing."""
        counts = {}
        for kind, idle in self.idle.items():
            alive = [entry for entry in idle if entry.process.poll() is None]
            ready = sum(entry.ready for entry in alive)
            counts[kind] = (ready, len(alive) - ready)
        return counts

    def take(self, command: list[str]) -> tuple[subprocess.Popen, list[str]] | None:
        """An idle interpreter for ``command`` (``python -m MODULE ARGS``) and the argv to give it, or None
        when its kind is not pooled or none is idle."""
        if command[:2] != [sys.executable, "-m"] or len(command) < 3:
            return None
        kind = next((k for k, module in MODULES.items() if module == command[2]), None)
        idle = self.idle.get(kind)
        while idle:
            entry = idle.popleft()
            entry.process.stdout.close()  # it says nothing more to erld: its output goes to its log
            if entry.process.poll() is None:
                # One still importing finishes at the normal priority; the interpreter also raises
                # itself when it takes the assignment, in case it lowered itself only after this.
                normal_priority(entry.process.pid)
                return entry.process, command[2:]
        return None

    def close(self) -> None:
        """End every idle interpreter (erld is stopping)."""
        for idle in self.idle.values():
            while idle:
                entry = idle.popleft()
                _kill_group(entry.process.pid)
                entry.process.wait()

    def end_leftovers(self, adopted: set[int]) -> int:
        """End this node's pool interpreters that no process record knows (a dead erld's); return how many.
        Another cluster's erld on the same host may name its node the same: its interpreters have another
        etcd in their environment."""
        ended = 0
        for process in psutil.process_iter(["pid"]):
            if process.pid in adopted:
                continue
            try:
                environ = process.environ()
                mine = environ.get(POOL_NODE) == self.node and environ.get(jobenv.ETCD) == self.etcd_endpoint
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            if mine:
                _kill_group(process.pid)
                ended += 1
        return ended


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
