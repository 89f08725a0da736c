"""The embedded etcd: erld starts the ``etcd`` binary itself when given no ``--etcd`` endpoint.

Its data lives under the daemon's state dir and it listens on loopback only.
When erld crashes its etcd keeps running; the restarted erld finds it by the
pid file in the state dir and adopts it instead of starting a second one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from elastic_rl.errors import ElasticRLError
from elastic_rl.net import free_port
from elastic_rl.store.client import StoreUnavailable, etcd_answers
from elastic_rl.store.credentials import EtcdCredentials

INSTALL_HINT = "install it with `apt-get install etcd-server` (Debian/Ubuntu) or run `make setup`"


class EtcdMissing(ElasticRLError):
    """The etcd binary is not installed."""


def etcd_command(
    data_dir: Path, client_port: int, peer_port: int, name: str = "erl", initial_cluster: str | None = None
) -> list[str]:
    """One etcd member on loopback; ``initial_cluster`` (name=peer URL, comma-separated) for a member
    of several, else a cluster of one."""
    binary = shutil.which("etcd")
    if binary is None:
        raise EtcdMissing(f"no `etcd` binary on PATH for the embedded etcd; {INSTALL_HINT}")
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        binary,
        "--name",
        name,
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        initial_cluster or f"{name}={peer}",
        "--initial-cluster-state",
        "new",
        "--logger",
        "zap",
        "--log-level",
        "warn",
    ]


class EmbeddedEtcd:
    def __init__(
        self,
        state_dir: Path,
        client_port: int = 2379,
        peer_port: int | None = None,
        environment: dict[str, str] | None = None,
    ):
        self.data_dir = state_dir / "etcd"
        self.client_port = client_port
        # Peers never connect to a single-member etcd: any free port will do.
        self.peer_port = peer_port or free_port()
        self.endpoint = f"http://127.0.0.1:{client_port}"
        self.pid_file = state_dir / "etcd.pid"
        self.environment = environment
        self.process: subprocess.Popen | None = None
        self.adopted_pid: int | None = None

    async def _answers(self) -> bool:
        # Plain text on loopback, whatever credentials the environment names for other etcds.
        return await etcd_answers(self.endpoint, EtcdCredentials())

    def _previous_pid(self) -> int | None:
        """The pid of an etcd a previous erld started here, if it still runs."""
        try:
            pid = int(self.pid_file.read_text())
            os.kill(pid, 0)
            return pid
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None

    async def start(self, timeout_s: float = 30.0) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        previous = self._previous_pid()
        if previous is not None and await self._answers():
            self.adopted_pid = previous
            return
        log = open(self.data_dir.parent / "etcd.log", "ab")
        self.process = subprocess.Popen(
            etcd_command(self.data_dir, self.client_port, self.peer_port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.environment,
        )
        self.pid_file.write_text(str(self.process.pid))
        deadline = time.monotonic() + timeout_s
        while not await self._answers():
            if self.process.poll() is not None:
                raise ElasticRLError(f"embedded etcd exited with code {self.process.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                raise StoreUnavailable(f"embedded etcd did not answer at {self.endpoint} within {timeout_s:.0f}s")
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        if self.adopted_pid is not None:
            try:
                os.kill(self.adopted_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        elif self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.pid_file.unlink(missing_ok=True)
