"""erld's life from the command line: `erl daemon` runs it in the foreground (as systemd does),
`erl run` starts one in the background when none is running, and `erl shutdown` stops that one again
by the pid it left in its state dir."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import psutil

from daemon.pool import DEFAULT_SIZES
from elastic_rl import jobs
from elastic_rl.cli.common import add_command, add_etcd_credential_options
from elastic_rl.errors import ElasticRLError, InputError
from elastic_rl.net import LOOPBACK
from elastic_rl.store.client import Store, etcd_answers
from policies.memory import GIB

DAEMON_STATE_DIR = Path("runs/.erld")


def _pool_size(text: str) -> tuple[str, int]:
    kind, _, size = text.partition("=")
    if kind not in DEFAULT_SIZES or not size.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: give KIND=N with KIND one of {', '.join(DEFAULT_SIZES)} and N a whole number (0: none)"
        )
    return kind, int(size)


def _gib_bytes(gib: float | None) -> int | None:
    if gib is None:
        return None
    if gib <= 0:
        raise InputError(f"--slot-memory {gib:g}: give the GiB one slot may use, more than 0")
    return int(gib * GIB)


def cmd_daemon(args: argparse.Namespace) -> int:
    import logging
    import socket

    from daemon.erld import NodeConfig, serve
    from daemon.gpus import node_gpus
    from policies.devices import DeviceKind

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.gpus and args.slot_memory is not None:
        raise InputError("--slot-memory is for CPU nodes: a GPU node's slots hold what NVML says its GPUs hold")
    gpus = node_gpus(args.gpus) if args.gpus else None
    config = NodeConfig(
        name=args.node or socket.gethostname(),
        advertise_host=args.advertise_host,
        devices=len(gpus.cuda_indices) if gpus else args.cpu_devices,
        device_kind=DeviceKind.CUDA if gpus else DeviceKind.CPU,
        gpu_ids=gpus.cuda_indices if gpus else (),
        slot_memory=gpus.slot_memory if gpus else _gib_bytes(args.slot_memory),
        lease_ttl_s=args.lease_ttl,
        device_cooldown_s=args.device_cooldown,
        metrics_port=args.metrics_port,
        drain_on_term_s=args.drain_on_term,
        pool_sizes={**DEFAULT_SIZES, **dict(args.pool)},
    )
    asyncio.run(serve(args.etcd, config, args.state_dir, args.etcd_port))
    return 0


def cmd_shutdown(args: argparse.Namespace) -> int:
    """Stop the erld that `erl run` started in the background (by the pid it left in its state dir)."""
    pid_file = args.state_dir / "erld.pid"
    try:
        pid = int(pid_file.read_text())
        process = psutil.Process(pid)
        if "daemon" not in process.cmdline():
            raise psutil.NoSuchProcess(pid)
    except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
        raise ElasticRLError(f"no background erld runs from {args.state_dir} (`erl run` starts one)") from None
    print(f"stopping erld (pid {pid}): its jobs' processes stop, and the jobs resume when an erld starts again")
    process.terminate()
    deadline = time.monotonic() + args.timeout
    while _running(process):
        if time.monotonic() > deadline:
            raise ElasticRLError(
                f"erld (pid {pid}) did not stop within {args.timeout:.0f} s; see {args.state_dir / 'erld.log'}"
            )
        time.sleep(0.2)
    pid_file.unlink(missing_ok=True)
    print("erld stopped")
    return 0


def _running(process: psutil.Process) -> bool:
    """Alive, and not a zombie its parent has yet to reap."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def daemon_running(endpoint: str) -> bool:
    async with Store(endpoint, timeout_s=2.0, attempts=1) as store:
        try:
            await jobs.require_daemon(store)
        except jobs.NoDaemon:
            return False
    return True


async def start_background_daemon(endpoint: str, slots: list[str]) -> int:
    """Start `erl daemon` with the device ``slots`` arguments in its own session; it outlives `erl run`.

    It uses the etcd already at ``endpoint`` if one answers there (Debian's
    etcd-server runs one as a service), else starts an embedded one on that port.
    """
    DAEMON_STATE_DIR.mkdir(parents=True, exist_ok=True)
    if await etcd_answers(endpoint):
        etcd_args = ["--etcd", endpoint]
    else:
        etcd_args = ["--etcd-port", endpoint.rsplit(":", 1)[1]]
    log = open(DAEMON_STATE_DIR / "erld.log", "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "elastic_rl.cli", "daemon", "--state-dir", str(DAEMON_STATE_DIR), *slots, *etcd_args],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    (DAEMON_STATE_DIR / "erld.pid").write_text(str(process.pid))
    deadline = time.monotonic() + 60
    while not await daemon_running(endpoint):
        if process.poll() is not None or time.monotonic() > deadline:
            raise ElasticRLError(f"erld did not start; see {DAEMON_STATE_DIR / 'erld.log'}")
        await asyncio.sleep(0.3)
    return process.pid


def add_erld_commands(commands) -> None:
    """`erl shutdown`, `erl daemon`."""
    shutdown = add_command(
        commands,
        "shutdown",
        "stop the erld that `erl run` started in the background",
        "erl shutdown",
        cmd_shutdown,
        etcd=False,
    )
    shutdown.add_argument("--state-dir", type=Path, default=DAEMON_STATE_DIR, help="that erld's state dir")
    shutdown.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for it to stop")

    daemon = add_command(
        commands,
        "daemon",
        "run erld, the node daemon (systemd runs it as a service)",
        "erl daemon --node gpu-07 --advertise-host 10.0.0.7 --gpus all "
        "--etcd http://10.0.0.1:2379,http://10.0.0.2:2379,http://10.0.0.3:2379",
        cmd_daemon,
        etcd=False,
    )
    daemon.add_argument(
        "--etcd", metavar="URL[,URL...]", help="an etcd cluster's members; without it erld starts an embedded etcd"
    )
    daemon.add_argument("--etcd-port", type=int, default=2379, help="client port of the embedded etcd")
    add_etcd_credential_options(daemon)
    slots = daemon.add_mutually_exclusive_group()
    slots.add_argument("--cpu-devices", type=int, default=4, help="device slots this node offers (CPU nodes)")
    slots.add_argument(
        "--gpus",
        metavar="all|N",
        help="offer this node's GPUs as its device slots: all of them, or the first N (found through NVML; "
        "only those an inherited CUDA_VISIBLE_DEVICES lists)",
    )
    daemon.add_argument(
        "--slot-memory",
        type=float,
        metavar="GIB",
        help="CPU nodes: the memory one slot may use, in GiB; `erl submit` refuses a job whose trainer "
        "rank needs more (a GPU node's slots report their GPU's memory)",
    )
    daemon.add_argument("--state-dir", type=Path, default=DAEMON_STATE_DIR, help="embedded etcd data and erld state")
    daemon.add_argument("--node", help="node name, one erld per name (default: the hostname)")
    daemon.add_argument(
        "--advertise-host",
        default=LOOPBACK,
        help="the address this node's servers bind and other nodes reach them at (default: 127.0.0.1)",
    )
    daemon.add_argument(
        "--lease-ttl",
        type=int,
        default=10,
        metavar="S",
        help="seconds without renewal after which the node counts as dead and its work moves",
    )
    daemon.add_argument(
        "--device-cooldown",
        type=float,
        metavar="S",
        help="a failed device is usable again after S seconds (default: only after `erl devices reset`)",
    )
    daemon.add_argument("--metrics-port", type=int, metavar="PORT", help="serve /metrics and /healthz on this port")
    daemon.add_argument(
        "--drain-on-term",
        type=float,
        metavar="S",
        help="on SIGTERM (Slurm's --signal, a preemption watcher, systemctl stop) first drain this node within S "
        "seconds: its job processes leave at safe points and move to other nodes; a second SIGTERM stops at once",
    )
    sizes = ", ".join(f"{kind}={size}" for kind, size in DEFAULT_SIZES.items())
    daemon.add_argument(
        "--pool",
        type=_pool_size,
        action="append",
        default=[],
        metavar="KIND=N",
        help="keep N idle pre-imported interpreters of a process kind (trainer, orchestrator, engine), so its "
        "starts and restarts skip the imports; 0 turns the kind off; repeatable. Each costs the host memory the "
        f"process holds after its imports (a trainer's about 430 MB), no device. Default: {sizes}",
    )
