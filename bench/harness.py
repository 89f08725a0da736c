"""What the benchmarks share beyond the chaos harness (``chaos/``: erlds, faults, the `erl` CLI):
the `erl` output as text, an erld for the length of a block, and the times in process logs.
"""

from __future__ import annotations

import re
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chaos.erl_cli import erl as erl_process  # noqa: E402
from chaos.erl_cli import job_status as chaos_job_status  # noqa: E402
from chaos.topology import Topology  # noqa: E402
from elastic_rl.net import free_port  # noqa: E402, F401 (the benchmarks' ports)

SPEC = REPO / "examples" / "tiny-grpo.yaml"


def erl(*args: str) -> str:
    return erl_process(*args, check=True).stdout


def job_status(endpoint: str, job: str = "tiny-grpo") -> dict:
    return chaos_job_status(endpoint, job)


def submit(endpoint: str, spec: Path, name: str, workdir: Path, overrides: list[str]) -> None:
    """`erl submit` ``spec`` as job ``name`` with these ``--set`` overrides."""
    sets = [arg for override in [f"name={name}", *overrides] for arg in ("--set", override)]
    erl("submit", str(spec), *sets, "--workdir", str(workdir), "--etcd", endpoint)


def finished(endpoint: str, name: str, workdir: Path) -> list[dict]:
    """The job's metric lines, one per rollout, once it has succeeded, each with ``minutes`` since its start."""
    while (phase := job_status(endpoint, name)["status"]["phase"]) not in ("succeeded", "failed"):
        time.sleep(0.5)
    assert phase == "succeeded", job_status(endpoint, name)
    return metric_lines(workdir)


def stopped_after(
    endpoint: str, spec: Path, name: str, workdir: Path, overrides: list[str], minutes: float
) -> list[dict]:
    """Run job ``name`` for ``minutes`` of wall time, then `erl stop` it: its metric lines, one per
    finished rollout, each with ``minutes`` since its start."""
    submit(endpoint, spec, name, workdir, ["rollout.num_rollouts=10000", *overrides])
    deadline = time.monotonic() + minutes * 60
    while time.monotonic() < deadline:
        phase = job_status(endpoint, name)["status"]["phase"]
        assert phase in ("pending", "running"), job_status(endpoint, name)
        time.sleep(5)
    erl("stop", name, "--etcd", endpoint)
    while job_status(endpoint, name)["status"]["phase"] != "stopped":
        time.sleep(1)
    return metric_lines(workdir)


def metric_lines(workdir: Path) -> list[dict]:
    """The job's metric lines, one per rollout, each with ``minutes`` since the job's start."""
    started = orjson.loads((workdir / "events.jsonl").read_text().splitlines()[0])["time"]
    lines = [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{**line, "minutes": (line["time"] - started) / 60} for line in lines]


@contextmanager
def running_daemon(root: Path, cpu_devices: int):
    """An erld (and its embedded etcd) for the length of the block; yields its etcd endpoint."""
    with Topology.single(root, cpu_devices) as topology:
        yield topology.endpoint


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
