"""Helpers for tests that drive a real erld: the `erl` CLI, a daemon fixture, job status."""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from chaos.erl_cli import erl, job_status
from chaos.faults import inject
from chaos.runner import run_job as chaos_run_job
from chaos.scenario import Fault, FaultKind
from chaos.topology import Topology
from daemon.pool import DEFAULT_SIZES
from elastic_rl.spec.loading import load_spec
from tests.processes import SPEC

STOP_AND_RESUME = "erl stop + erl resume"


def receive(sock: socket.socket, timeout: float, until: str, process: subprocess.Popen | None = None) -> list[str]:
    messages = []
    deadline = time.monotonic() + timeout
    sock.settimeout(0.5)
    while time.monotonic() < deadline and (process is None or process.poll() is None):
        try:
            message = sock.recv(4096).decode()
        except TimeoutError:
            continue
        messages.append(message)
        if message.startswith(until):
            break
    return messages


NO_POOL = {kind: 0 for kind in DEFAULT_SIZES}
"""Most tests keep no pre-imported interpreters: on 2 cores their imports compete with the job, even at
the lowest priority (docs/benchmarks/recovery.md)."""


@contextlib.contextmanager
def running_daemon(
    root: Path, gpus: str | None = None, pool: dict[str, int] = NO_POOL, metrics: bool = False, slots: int = 8
) -> Iterator[Topology]:
    """One erld (node "test-node", ``slots`` device slots, or with ``gpus`` the machine's GPUs, and an
    embedded etcd, with ``pool``'s interpreters; ``metrics``: serving /metrics) with its systemd notify
    socket captured as ``.notify``, stopped at the end."""
    notify_path = root / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        environment = {"NOTIFY_SOCKET": str(notify_path)}
        topology = Topology.single(
            root, cpu_devices=slots, environment=environment, name="test-node", gpus=gpus, pool=pool, metrics=metrics
        )
        with topology:
            topology.notify = notify
            yield topology


@pytest.fixture
def daemon(tmp_path):
    with running_daemon(tmp_path) as topology:
        yield topology


def metrics(workdir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def status(daemon: Topology, job: str) -> dict:
    return job_status(daemon.endpoint, job)


def wait_phase(daemon: Topology, job: str, phases: tuple[str, ...], deadline: float) -> dict:
    while (info := status(daemon, job))["status"]["phase"] not in phases:
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    return info


def run_job(
    daemon: Topology,
    workdir: Path,
    job_args: list[str],
    faults: list[tuple[str | Callable[[], None], int | Callable[[Path], bool]]] = (),
    jitter=None,
    signal_number: int = signal.SIGKILL,
    timeout_s: float = 500,
    spec: Path = SPEC,
    expect: tuple[str, ...] = ("succeeded",),
) -> list[str]:
    """Run a job to the end through the chaos harness, injecting fault F once N rollouts are done, for each (F, N).

    N may instead be a predicate of the work dir. A fault is a job process's name (sent
    ``signal_number``: SIGKILL, or SIGSTOP to hang it), "erld" (SIGKILLed and started again),
    STOP_AND_RESUME, or any other action as a function. ``jitter`` (a random.Random) delays each
    fault by a random part of a second. The job must end in a phase of ``expect``. Returns the faults
    injected, by name.
    """
    overrides = [job_args[i + 1] for i in range(0, len(job_args), 2)]
    actions = []
    for fault, moment in faults:
        if fault == "erld":
            action = Fault(kind=FaultKind.KILL_ERLD, target="leader")
        elif fault == STOP_AND_RESUME:
            action = stop_and_resume(daemon, load_spec(spec).name)
        elif isinstance(fault, str):
            kind = FaultKind.HANG if signal_number == signal.SIGSTOP else FaultKind.KILL
            action = Fault(kind=kind, target=fault, duration_s=3600)
        else:
            action = fault
        actions.append((action, moment))
    run = chaos_run_job(daemon, spec, workdir, overrides, actions, rng=jitter, timeout_s=timeout_s, expect=expect)
    return [fault if isinstance(fault, str) else fault.__name__ for (fault, _), _ in zip(faults, run.injections)]


def stop_and_resume(daemon: Topology, job: str, layout: tuple[str, ...] = ()) -> Callable[[], None]:
    """`erl stop`, then `erl resume` (with ``layout``'s ``--set`` overrides of the replica layout)."""

    def stop_then_resume() -> None:
        erl("stop", job, "--etcd", daemon.endpoint, check=True)
        wait_phase(daemon, job, ("stopped",), time.monotonic() + 120)
        relaid = [arg for override in layout for arg in ("--set", override)]
        erl("resume", job, "--etcd", daemon.endpoint, *relaid, check=True)

    return stop_then_resume


def job_events(workdir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]


def overload_engines(daemon: Topology, job: str, workdir: Path, engines: list[str], duration_s: float) -> float:
    """Stall each of ``engines`` in SIGSTOP bursts (3 s of every 4: each shorter than any hang timeout) for
    ``duration_s``, all at once, as an overloaded machine would; returns when the bursts end."""
    info = status(daemon, job)
    burst = {"kind": FaultKind.SLOW_ENGINE, "duration_s": duration_s, "burst_s": 3, "period_s": 4}
    return max(
        inject(Fault(target=engine, **burst), daemon, info, workdir, random.Random(0)).ends for engine in engines
    )
