"""Benchmark: the controller at 10 to 1,000 nodes, simulated (``daemon.simulation``), against a real etcd.

    .venv/bin/python bench/controller_scale.py --nodes 10 100 300 1000 [--out results.json]
    .venv/bin/python bench/controller_scale.py --nodes 100 --secure     # etcd over TLS with auth

For each cluster size, a fresh etcd on disk and that many simulated erlds
(real erld code, fake processes, 8 CPU slots a node) in this process. One
job of up to 512 processes (trainer replicas of TP=2, one engine, the three
services; at most 64% of the slots) is submitted and measured:

- placement: from the submit to every process assigned, to every one reported running, and
  to the own view (its mirror) of every erld that runs a process of the job having them all;
  how many erlds follow the job (the leader and those running it: the others never hear of it);
- the steady state over 10 s: etcd requests per second (gRPC calls and stream messages
  received), etcd's watchers, erld passes (median and 95th percentile), the memory
  of etcd and of this process per simulated erld;
- a node death: a node holding two replicas dies (its erld stops, its lease unrevoked); the
  time until its lease runs out, and from then until its processes are assigned elsewhere;
- leases lost: how often a live erld found its own lease run out (it fences and joins again),
  over the whole run: none, or the host was too slow for the lease TTL.

With ``--secure`` etcd runs as a shared cluster runs it (TLS, client
certificates, auth on: ``tests/secure_etcd.py``) and every erld signs in.
Prints a markdown table and writes the figures as JSON. Every erld runs on
the host's cores beside etcd: the figures are this host's, the
ratios between sizes are what carries over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import ssl
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import median, quantiles

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from daemon.plan import SERVICES, proc_spec  # noqa: E402
from daemon.simulation import DEVICES_PER_NODE, SimulatedCluster  # noqa: E402
from elastic_rl import jobs  # noqa: E402
from elastic_rl.net import free_port  # noqa: E402
from elastic_rl.spec.loading import load_spec  # noqa: E402
from elastic_rl.store import keys  # noqa: E402
from elastic_rl.store.embedded import EmbeddedEtcd  # noqa: E402
from tests.secure_etcd import SecureEtcd  # noqa: E402

SPEC = REPO / "examples" / "tiny-grpo.yaml"
MAX_REPLICAS = 254  # 508 trainer ranks + 1 engine + 3 services = 512 processes
STEADY_S = 10.0


def job_spec(nodes: int, name: str):
    replicas = min(MAX_REPLICAS, int(nodes * DEVICES_PER_NODE * 0.64) // 2)
    overrides = [
        f"name={name}",
        f"trainer.replicas={replicas}",
        "trainer.tensor_parallel=2",
        "trainer.micro_batch_size=16",
        f"trainer.global_batch_size={replicas * 16}",
        f"rollout.prompts_per_rollout={replicas}",
        "engines.count=1",
    ]
    return load_spec(SPEC, overrides), 2 * replicas + 4


def etcd_metrics(endpoint: str) -> dict[str, float]:
    tls = None
    if endpoint.startswith("https://"):  # the client certificate the erlds use (ERL_ETCD_*)
        tls = ssl.create_default_context(cafile=os.environ["ERL_ETCD_CACERT"])
        tls.load_cert_chain(os.environ["ERL_ETCD_CERT"], os.environ["ERL_ETCD_KEY"])
    page = urllib.request.urlopen(f"{endpoint}/metrics", timeout=10, context=tls).read().decode()
    totals: dict[str, float] = {}
    for family in (
        "grpc_server_handled_total",
        "grpc_server_msg_received_total",
        "etcd_debugging_mvcc_watcher_total",
        "process_resident_memory_bytes",
    ):
        totals[family] = sum(float(v) for v in re.findall(rf"^{family}(?:{{[^}}]*}})? (\S+)$", page, re.M))
    return totals


async def start_etcd(root: Path, secure: bool) -> EmbeddedEtcd | SecureEtcd:
    if not secure:
        etcd = EmbeddedEtcd(root / "etcd", client_port=free_port())
        await etcd.start()
        return etcd
    etcd = SecureEtcd.create(root / "etcd")
    await asyncio.to_thread(etcd.start)
    await asyncio.to_thread(etcd.enable_auth)
    os.environ.update(etcd.credentials().environ())  # every Store of this process signs in
    return etcd


async def measure(nodes: int, root: Path, lease_ttl_s: int, secure: bool) -> dict:
    etcd = await start_etcd(root, secure)
    figures: dict = {"nodes": nodes, "lease_ttl_s": lease_ttl_s, "etcd": "TLS + auth" if secure else "plain"}
    try:
        rss_before = psutil.Process().memory_info().rss
        started = time.monotonic()
        async with SimulatedCluster(etcd.endpoint, nodes, root / "erlds", lease_ttl_s=lease_ttl_s) as cluster:
            figures["join_s"] = time.monotonic() - started
            spec, processes = job_spec(nodes, "sim-job")
            figures["processes"] = processes
            submitted = time.monotonic()
            await jobs.submit(cluster.observer, spec, root / "work")
            figures["placement_s"] = await cluster.placed(spec.name, processes, 300) - submitted
            figures["all_running_s"] = await cluster.running(spec.name, processes, 300) - submitted
            figures["settled_s"] = await cluster.settled(spec.name, processes, 600) - submitted
            figures["following"] = cluster.following(spec.name)
            cluster.freeze_heap()  # the job's records too

            cluster_passes = len(cluster.pass_seconds())
            before, window_start = etcd_metrics(etcd.endpoint), time.monotonic()
            await asyncio.sleep(STEADY_S)
            after, window = etcd_metrics(etcd.endpoint), time.monotonic() - window_start
            passes = cluster.pass_seconds()[cluster_passes:]
            for figure, family in (
                ("etcd_rpcs_per_s", "grpc_server_handled_total"),
                ("etcd_msgs_per_s", "grpc_server_msg_received_total"),
            ):
                figures[figure] = (after[family] - before[family]) / window
            figures["etcd_watchers"] = after["etcd_debugging_mvcc_watcher_total"]
            figures["etcd_rss_mb"] = after["process_resident_memory_bytes"] / 2**20
            figures["erld_rss_mb_each"] = (psutil.Process().memory_info().rss - rss_before) / 2**20 / nodes
            figures["passes_per_s"] = len(passes) / window
            figures["pass_p50_ms"] = 1000 * median(passes)
            figures["pass_p95_ms"] = 1000 * quantiles(passes, n=20)[-1]

            assigned = await cluster.assignments(spec.name)
            leader = await cluster.observer.get(keys.LEADER)
            services = {a["node"] for name, a in assigned.items() if proc_spec(name).group == SERVICES}
            by_node: dict[str, set[str]] = {}
            for name, assignment in assigned.items():
                by_node.setdefault(assignment["node"], set()).add(name)
            dead = next(node for node in sorted(by_node) if node not in services and node != leader)
            died = time.monotonic()
            cluster.crash(dead)
            expired = await cluster.node_gone(dead, 60)
            replaced = await cluster.replaced(spec.name, dead, by_node[dead], 120)
            figures["dead_node_processes"] = len(by_node[dead])
            figures["lease_expiry_s"] = expired - died
            figures["replaced_after_expiry_s"] = replaced - expired
            figures["death_to_replaced_s"] = replaced - died
            figures["leases_lost"] = cluster.leases_lost()
    finally:
        etcd.stop()
    return figures


COLUMNS = [
    ("nodes", "nodes", "{:.0f}"),
    ("etcd", "etcd", "{}"),
    ("lease_ttl_s", "lease TTL (s)", "{:.0f}"),
    ("processes", "job processes", "{:.0f}"),
    ("placement_s", "placed (s)", "{:.2f}"),
    ("all_running_s", "all running (s)", "{:.2f}"),
    ("settled_s", "its erlds' views current (s)", "{:.1f}"),
    ("following", "erlds following it", "{:.0f}"),
    ("lease_expiry_s", "death to lease expiry (s)", "{:.2f}"),
    ("replaced_after_expiry_s", "expiry to re-placed (s)", "{:.2f}"),
    ("death_to_replaced_s", "death to re-placed (s)", "{:.2f}"),
    ("leases_lost", "leases lost", "{:.0f}"),
    ("etcd_rpcs_per_s", "etcd RPCs/s", "{:.0f}"),
    ("etcd_msgs_per_s", "etcd msgs/s", "{:.0f}"),
    ("etcd_watchers", "watchers", "{:.0f}"),
    ("pass_p50_ms", "pass p50 (ms)", "{:.2f}"),
    ("pass_p95_ms", "pass p95 (ms)", "{:.2f}"),
    ("passes_per_s", "passes/s", "{:.0f}"),
    ("etcd_rss_mb", "etcd RSS (MB)", "{:.0f}"),
    ("erld_rss_mb_each", "per erld (MB)", "{:.2f}"),
]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) if key in row else "-" for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 300, 1000])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--secure", action="store_true", help="etcd over TLS with client certificates and auth")
    parser.add_argument(
        "--lease-ttl", type=int, default=10, help="the erlds' lease TTL in seconds (erl daemon's default: 10)"
    )
    args = parser.parse_args()
    # The fake processes serve nothing: the agents' calls to the router and engines fail, and say so.
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for nodes in args.nodes:
        # /dev/shm for the erlds' state files (a thousand nodes' disks are not this one); etcd on disk.
        with (
            tempfile.TemporaryDirectory(prefix="erl-scale-") as disk,
            tempfile.TemporaryDirectory(
                prefix="erl-scale-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
            ) as memory,
        ):
            root = Path(disk)
            (root / "erlds").symlink_to(memory)
            try:
                rows.append(asyncio.run(measure(nodes, root, args.lease_ttl, args.secure)))
            except TimeoutError as exc:
                rows.append({"nodes": nodes, "failed": str(exc)})
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
