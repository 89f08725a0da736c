"""What the benchmarks share: an erld with an embedded etcd, the `erl` CLI, job status, log times."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "examples" / "tiny-grpo.yaml"


def erl(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "elastic_rl.cli", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_status(endpoint: str, job: str = "tiny-grpo") -> dict:
    return orjson.loads(erl("status", job, "-o", "json", "--etcd", endpoint))


@contextmanager
def running_daemon(root: Path, cpu_devices: int):
    """An erld (and its embedded etcd) for the length of the block; yields its etcd endpoint."""
    port = free_port()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "elastic_rl.cli", "daemon", "--state-dir", str(root / "erld"),
         "--etcd-port", str(port), "--cpu-devices", str(cpu_devices)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(5)
        yield f"http://127.0.0.1:{port}"
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)


LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)[.,](\d{3})")


def log_lines(path: Path) -> list[tuple[float, str]]:
    """(epoch seconds, line) for each line of a process log that starts with a time (local time)."""
    timed = []
    for line in path.read_text(errors="replace").splitlines():
        match = LOG_TIME.match(line)
        if match:
            moment = datetime.strptime(f"{match[1]} {match[2]}", "%Y-%m-%d %H:%M:%S").timestamp()
            timed.append((moment + int(match[3]) / 1000, line))
    return timed


def events(workdir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
