"""Helpers that start the project's real servers as child processes for tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daemon.gpus import node_gpus
from daemon.plan import device_env
from elastic_rl import jobenv
from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.launcher import start_engine
from elastic_rl.engines.router import RouterClient, router_command
from elastic_rl.net import LOOPBACK, free_port, url
from elastic_rl.spec.engines import EnginesSpec
from policies.devices import DeviceKind, ProcessDevice

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "examples" / "tiny-grpo.yaml"
# Imported by `make models` (a step of `make test`).
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"


def export_checkpoint(out: Path, *overrides: str) -> Path:
    """Export an initial checkpoint of the tiny model through the real CLI module."""
    command = [sys.executable, "-m", "elastic_rl.model.export", str(SPEC), str(out)]
    for override in overrides:
        command += ["--set", override]
    subprocess.run(command, check=True, cwd=REPO, capture_output=True, timeout=120)
    return out


class Server:
    """A started server process and its URL."""

    def __init__(self, process: subprocess.Popen, port: int):
        self.process = process
        self.port = port
        self.url = url(port)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


@contextmanager
def cpu_engines(model_path: Path, count: int, log_dir: Path, secret: str | None = None) -> Iterator[list[Server]]:
    """``secret``: the job's secret the engines ask for, as under erld; none by default."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **({jobenv.SECRET: secret} if secret else {})}
    servers = []
    try:
        for index in range(count):
            port = free_port()
            log = open(log_dir / f"engine-{index}-{port}.log", "wb")
            servers.append(Server(start_engine(EnginesSpec(kind="cpu"), model_path, port, log, env=env), port))
        for server in servers:
            asyncio.run(EngineClient(server.url).wait_healthy(60, server.process))
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextmanager
def router(engines: list[Server], log_dir: Path, secret: str | None = None) -> Iterator[Server]:
    """``secret``: the job's secret the router asks for and passes on to the engines; none by default."""
    port = free_port()
    log = open(log_dir / f"router-{port}.log", "wb")
    env = {**os.environ, **({jobenv.SECRET: secret} if secret else {})}
    server = Server(
        subprocess.Popen(router_command(port, free_port()), stdout=log, stderr=subprocess.STDOUT, env=env), port
    )
    try:
        client = RouterClient(server.url, secret=secret)

        async def register() -> None:
            await client.wait_healthy(60, server.process)
            for engine in engines:
                await client.add_worker(engine.url)

        asyncio.run(register())
        yield server
    finally:
        server.stop()


def run_module_ranks(module: str, tp: int, *args, gpus: bool = False) -> None:
    """Run ``python -m module args`` as `tp` real processes in one group: gloo on CPU, or with ``gpus``
    NCCL, rank r on GPU r alone, as erld would start them."""
    port = free_port()
    processes = []
    for rank in range(tp):
        device = ProcessDevice(DeviceKind.CUDA, (rank,)) if gpus else ProcessDevice(DeviceKind.CPU)
        env = {
            **os.environ,
            **device_env(device, node_gpus("all").cuda_indices if gpus else ()),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(tp),
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, "-m", module, *map(str, args)]
        processes.append(subprocess.Popen(command, env=env, cwd=REPO, stderr=subprocess.PIPE))
    for process in processes:
        _, stderr = process.communicate(timeout=200)
        assert process.returncode == 0, stderr.decode()[-3000:]
