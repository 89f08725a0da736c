"""The faults: each one done to real processes, files and etcd the way hardware and software fail.

``inject`` carries out one fault on a running job and returns what it did (an
``Injection``: when, to what, which pids); a fault that finds no target raises
``NoTarget``, which fails the scenario. Faults that last (a hang, a failed
device, a full disk, a slow engine) end by themselves on a timer. The `nan`
fault is not injected here: it reaches the trainers through the environment
of the erlds that start them (``ERL_INJECT_NAN``).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos.erl_cli import erl
from chaos.scenario import Fault, FaultKind
from chaos.topology import Topology
from checkpoints.discovery import newest_valid_snapshot
from elastic_rl.store import keys
from elastic_rl.store.client import Store

SERVICE_ROLES = ("lighthouse", "router", "orchestrator")


class NoTarget(Exception):
    """A fault found nothing to act on (the runner waits a while for one first): the scenario fails
    rather than pass untested."""


@dataclass
class Injection:
    kind: str
    target: str
    time: float
    pids: list[int] = field(default_factory=list)
    node: str | None = None
    device: int | None = None
    ends: float | None = None
    """When a lasting fault ends by itself."""

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None and v != []}


def _later(seconds: float, action) -> None:
    """Run ``action`` after ``seconds`` on a timer thread (the fault ends by itself)."""
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _pick_process(status: dict, target: str | int | None, rng: random.Random) -> tuple[str, dict]:
    running = {name: p for name, p in status["procs"].items() if p.get("state") == "running" and p.get("pid")}
    if target in (None, "any"):
        candidates = sorted(running)
    elif target in running:
        candidates = [target]
    else:
        candidates = sorted(n for n, p in running.items() if p.get("role") == target)
    if not candidates:
        raise NoTarget(f"no running process matches {target!r} (running: {', '.join(sorted(running)) or 'none'})")
    name = rng.choice(candidates)
    return name, running[name]


def _pick_node(topology: Topology, status: dict, target: str | int | None) -> str:
    if target == "leader":
        name = topology.leader()
    elif target == "services":
        name = status["procs"].get("orchestrator", {}).get("node")
    elif target in status["procs"]:
        name = status["procs"][target].get("node")  # the node a named process runs on
    else:
        name = str(target) if target is not None else topology.nodes[0].name
    if name is None or name not in {node.name for node in topology.nodes}:
        raise NoTarget(f"no node {target!r} to fail")
    return name


def inject(fault: Fault, topology: Topology, status: dict, workdir: Path, rng: random.Random) -> Injection:
    now = time.time()
    kind = fault.kind
    if kind is FaultKind.KILL:
        name, proc = _pick_process(status, fault.target, rng)
        _signal([proc["pid"]], signal.SIGKILL)
        return Injection(kind.value, name, now, [proc["pid"]], proc.get("node"), proc.get("device"))
    if kind in (FaultKind.HANG, FaultKind.SLOW_ENGINE):
        name, proc = _pick_process(status, fault.target, rng)
        pid = [proc["pid"]]
        if kind is FaultKind.HANG:
            _signal(pid, signal.SIGSTOP)
            _later(fault.duration_s, lambda: _signal(pid, signal.SIGCONT))
        else:
            _burst(pid, fault.burst_s, fault.period_s, now + fault.duration_s)
        return Injection(kind.value, name, now, pid, proc.get("node"), proc.get("device"), now + fault.duration_s)
    if kind is FaultKind.SLOW_TRAINER:
        replica = int(fault.target or 0)
        ranks = {
            name: proc
            for name, proc in status["procs"].items()
            if name.startswith(f"trainer-{replica}-") and proc.get("state") == "running" and proc.get("pid")
        }
        if not ranks:
            raise NoTarget(f"no running rank of trainer replica {replica}")
        pids = [proc["pid"] for proc in ranks.values()]
        _burst(pids, fault.burst_s, fault.period_s, now + fault.duration_s)
        first = ranks[min(ranks)]
        return Injection(
            kind.value, f"trainer-{replica}", now, pids, first.get("node"), first.get("device"), now + fault.duration_s
        )
    if kind is FaultKind.KILL_DEVICE:
        node, device = _device_of(status, fault.target, rng)
        on_it = [
            p["pid"]
            for p in status["procs"].values()
            if p.get("node") == node and p.get("device") == device and p.get("pid")
        ]
        if not on_it:
            raise NoTarget(f"no process runs on device {device} of node {node}")
        asyncio.run(_fail_device(topology.endpoint, node, device, fault.duration_s))
        _signal(on_it, signal.SIGKILL)
        return Injection(kind.value, f"{node}/{device}", now, on_it, node, device, now + fault.duration_s)
    if kind is FaultKind.KILL_ERLD:
        node = topology.node(_pick_node(topology, status, fault.target or "leader"))
        pid = node.process.pid
        node.restart()
        return Injection(kind.value, node.name, now, [pid], node.name)
    if kind is FaultKind.KILL_NODE:
        node = topology.node(_pick_node(topology, status, fault.target))
        return Injection(kind.value, node.name, now, node.kill_node(), node.name)
    if kind is FaultKind.PARTITION:
        node = topology.node(_pick_node(topology, status, fault.target))
        node.link.cut()
        _later(fault.duration_s, node.link.heal)
        pids = sorted(node.job_pids())
        return Injection(kind.value, node.name, now, pids, node.name, ends=now + fault.duration_s)
    if kind is FaultKind.KILL_ETCD_MEMBER:
        index = int(fault.target or 0)
        topology.etcd.kill(index)
        _later(fault.duration_s, lambda: topology.etcd.restart(index))
        return Injection(kind.value, f"etcd-{index}", now, ends=now + fault.duration_s)
    if kind is FaultKind.CORRUPT_SNAPSHOT:
        snapshot = newest_valid_snapshot(workdir)
        if snapshot is None:
            raise NoTarget("no committed snapshot to corrupt yet")
        data = max(
            (p for p in snapshot.path.rglob("*") if p.is_file() and p.suffix != ".json"), key=lambda p: p.stat().st_size
        )
        with open(data, "r+b") as handle:
            handle.seek(data.stat().st_size // 2)
            chunk = handle.read(64)
            handle.seek(data.stat().st_size // 2)
            handle.write(bytes(b ^ 0xFF for b in chunk))
        return Injection(kind.value, str(snapshot.path.relative_to(workdir)), now)
    if kind is FaultKind.SCALE_ENGINES:
        exactly = f"{fault.target}:{fault.target}"  # a new range of one count, whatever the job's range was
        scaled = erl("scale", status["job"], "--engines", exactly, "--etcd", topology.endpoint)
        if scaled.returncode != 0:
            raise NoTarget(f"`erl scale` refused: {scaled.stderr.strip()}")
        return Injection(kind.value, f"{fault.target} engines", now)
    if kind is FaultKind.DRAIN:
        name = _pick_node(topology, status, fault.target)
        erl("drain", name, "--deadline", str(fault.duration_s), "--etcd", topology.endpoint, check=True)
        return Injection(kind.value, name, now, [], name, ends=now + fault.duration_s)
    if kind is FaultKind.PREEMPT:
        node = topology.node(_pick_node(topology, status, fault.target))
        node.process.send_signal(signal.SIGTERM)  # the notice: erld drains its node
        _later(fault.duration_s, node.kill_node)
        return Injection(kind.value, node.name, now, [node.process.pid], node.name, ends=now + fault.duration_s)
    if kind is FaultKind.JOIN_NODE:
        node = topology.join(int(fault.target or topology.nodes[0].cpu_devices))
        return Injection(kind.value, node.name, now, [node.process.pid], node.name)
    if kind is FaultKind.FILL_DISK:
        filler = workdir / ".chaos-fill"
        _fill(filler)
        _later(fault.duration_s, lambda: filler.unlink(missing_ok=True))
        return Injection(kind.value, str(workdir), now, ends=now + fault.duration_s)
    raise NoTarget(f"{kind.value} faults are not injected at run time")


def _device_of(status: dict, target, rng: random.Random) -> tuple[str, int]:
    """A device named node/slot, or the device of a process (by name or role)."""
    if isinstance(target, str) and "/" in target:
        node, slot = target.split("/")
        return node, int(slot)
    _, proc = _pick_process(
        {"procs": {n: p for n, p in status["procs"].items() if p.get("device") is not None}}, target, rng
    )
    return proc["node"], proc["device"]


async def _fail_device(endpoint: str, node: str, device: int, duration_s: float) -> None:
    """Mark the slot failed in the device ledger until the fault ends: placement avoids it meanwhile."""
    async with Store(endpoint) as store:
        now = time.time()
        await store.put(
            keys.ledger_entry(node, device),
            {"state": "failed", "reason": "chaos: device killed", "since": now, "until": now + duration_s},
        )


def _burst(pids: list[int], burst_s: float, period_s: float, until: float) -> None:
    def cycle() -> None:
        while time.time() < until:
            _signal(pids, signal.SIGSTOP)
            time.sleep(min(burst_s, max(0.0, until - time.time())))
            _signal(pids, signal.SIGCONT)
            time.sleep(max(0.0, period_s - burst_s))

    threading.Thread(target=cycle, daemon=True).start()


def _fill(path: Path) -> None:
    """Write until the filesystem says no room."""
    block = b"\0" * (1 << 20)
    with open(path, "wb") as handle:
        try:
            while True:
                handle.write(block)
                handle.flush()
        except OSError:
            pass
