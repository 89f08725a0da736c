"""Helpers for tests that drive a real erld: the `erl` CLI, a daemon fixture, job status."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from elastic_rl.net import free_port
from tests.processes import REPO, SPEC

STOP_AND_RESUME = "erl stop + erl resume"


def erl(*args: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_rl.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, check=check,
    )  # fmt: skip


class Daemon:
    """`erl daemon` with an embedded etcd, its systemd notify socket captured."""

    def __init__(self, state_dir: Path, port: int, notify_path: Path):
        self.state_dir, self.port, self.notify_path = state_dir, port, notify_path
        self.endpoint = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "NOTIFY_SOCKET": str(self.notify_path)}
        log = open(self.state_dir / "erld-test.log", "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "elastic_rl.cli", "daemon", "--state-dir", str(self.state_dir),
             "--etcd-port", str(self.port), "--cpu-devices", "8", "--node", "test-node"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def wait_ready(self, notify: socket.socket, timeout: float = 60) -> list[str]:
        messages = receive(notify, timeout, until="READY=1", process=self.process)
        assert any(m.startswith("READY=1") for m in messages), (self.state_dir / "erld-test.log").read_text()
        return messages


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


@pytest.fixture
def daemon(tmp_path):
    notify_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        server = Daemon(tmp_path / "state", free_port(), notify_path)
        server.state_dir.mkdir()
        server.start()
        server.wait_ready(notify)
        server.notify = notify
        yield server
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
            server.process.wait(timeout=60)
        # The embedded etcd of a SIGKILLed erld may still run: stop it by its pid file.
        pid_file = server.state_dir / "etcd.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass


def metrics(workdir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def status(daemon: Daemon, job: str) -> dict:
    return orjson.loads(erl("status", job, "-o", "json", "--etcd", daemon.endpoint, check=True).stdout)




def wait_phase(daemon: Daemon, job: str, phases: tuple[str, ...], deadline: float) -> dict:
    while (info := status(daemon, job))["status"]["phase"] not in phases:
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    return info


def run_job(
    daemon: Daemon,
    workdir: Path,
    job_args: list[str],
    faults: list[tuple[str | Callable[[], None], int | Callable[[Path], bool]]] = (),
    jitter=None,
    signal_number: int = signal.SIGKILL,
    timeout_s: float = 500,
) -> list[str]:
    """Run the tiny job to the end, injecting fault F once `rollouts_done` reaches N, for each (F, N).

    N may instead be a predicate of the work dir (e.g. "a replica has healed").
    A fault is a job process's name (sent ``signal_number``), "erld" (SIGKILLed and
    started again), STOP_AND_RESUME, or any other action as a function. ``jitter`` (a random.Random) delays each fault
    by a random part of a second, so kills land anywhere in a rollout:
    mid-generation, mid-commit, mid-snapshot. Returns the faults injected.
    """
    erl("submit", str(SPEC), *job_args, "--workdir", str(workdir), "--etcd", daemon.endpoint, check=True)
    done = []
    deadline = time.monotonic() + timeout_s
    pending = list(faults)
    while (info := status(daemon, "tiny-grpo"))["status"]["phase"] in ("pending", "running"):
        when = pending[0][1] if pending else None
        if pending and (when(workdir) if callable(when) else info["progress"].get("rollouts_done", 0) >= when):
            fault, _ = pending.pop(0)
            if jitter is not None:
                time.sleep(jitter.uniform(0, 0.8))
            if callable(fault):
                fault()
                done.append(fault.__name__)
            elif fault == "erld":
                daemon.process.kill()
                daemon.process.wait(timeout=10)
                daemon.start()
                daemon.wait_ready(daemon.notify)
                done.append(fault)
            elif fault == STOP_AND_RESUME:
                erl("stop", "tiny-grpo", "--etcd", daemon.endpoint, check=True)
                wait_phase(daemon, "tiny-grpo", ("stopped",), deadline)
                erl("resume", "tiny-grpo", "--etcd", daemon.endpoint, check=True)
                done.append(fault)
            elif (proc := info["procs"].get(fault, {})).get("state") == "running":
                os.kill(proc["pid"], signal_number)
                done.append(fault)
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.2)
    assert info["status"]["phase"] == "succeeded", info
    return done


def job_events(workdir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
