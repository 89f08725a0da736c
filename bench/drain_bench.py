"""Benchmark: what a drained node costs a job, against the same node killed.

    .venv/bin/python bench/drain_bench.py [--repeats 2] [--lease-ttl 4]

The tiny GRPO job (2 replicas, 2 engines, 40 rollouts) on three erlds with three slots each, a
one-member etcd and a 4 s node lease (`--lease-ttl`: erld's default is 10 s; a kill's cost grows with it,
a drain's does not), submitted once every erld's pre-imported interpreters are ready.
Once 6 rollouts are trained, the node holding the job's services (with a replica or an engine beside
them, where placement puts one) is either drained (`erl drain --deadline 120`) or killed with
everything on it; drain and kill alternate, `--repeats` times each. Waiting for the pools matters on
a 2-core machine: beside a job that keeps both cores busy, three erlds' pools import at the lowest
CPU priority for minutes, and a process handed an interpreter still importing waits for it (3.5 s for
the orchestrator, which a drain moves and a kill restarts alike).

Time lost: the trainers' progress is the weights they publish (``weights/<version>``, one per
rollout); the pace is the median time between versions over the rollouts before the fault, and the
time lost is how much later than that pace the 8th version after the fault lands. From the drains'
events, the time from the drain's start (``node_draining``) to each process kind leaving: an engine
out of the router and stopped, a replica out of the quorum, the orchestrator gone after its commit,
the services started elsewhere, and the node empty (``node_drained``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos.topology import Topology  # noqa: E402
from checkpoints import layout  # noqa: E402
from daemon.pool import DEFAULT_SIZES  # noqa: E402

from harness import SPEC, erl, events, free_port, job_status  # noqa: E402

FAULT_AFTER = 6  # rollouts trained
AFTER = 8  # versions after the fault that the time lost is measured to
ROLLOUTS = 40


def pool_ready(node) -> bool:
    return all(node.ready_interpreters().get(kind, 0) >= size for kind, size in DEFAULT_SIZES.items())


def run(root: Path, fault: str, lease_ttl_s: int) -> tuple[float, dict[str, float]]:
    """The time lost to the fault, and (for a drain) the time from its start to each kind leaving."""
    topology = Topology.cluster(root / "cluster", nodes=3, cpu_devices=3, etcd_members=1, lease_ttl_s=lease_ttl_s)
    for node in topology.nodes:
        node.metrics_port = free_port()
    workdir = root / "job"
    with topology:
        deadline = time.monotonic() + 300
        while not all(pool_ready(node) for node in topology.nodes) and time.monotonic() < deadline:
            time.sleep(1)
        erl(
            "submit",
            str(SPEC),
            *("--set", f"rollout.num_rollouts={ROLLOUTS}", "--set", "trainer.replicas=2"),
            *("--set", "engines.count=2", "--set", "fault_tolerance.quorum_timeout_s=20"),
            *("--set", "fault_tolerance.collective_timeout_s=10", "--set", "checkpoints.keep_last=1000"),
            *("--workdir", str(workdir), "--etcd", topology.endpoint),
        )
        struck = None
        while (info := job_status(topology.endpoint))["status"]["phase"] in ("pending", "running"):
            if struck is None and info["progress"].get("rollouts_done", 0) >= FAULT_AFTER:
                node = info["procs"]["orchestrator"]["node"]
                struck = time.time()
                if fault == "drain":
                    erl("drain", node, "--deadline", "120", "--etcd", topology.endpoint)
                else:
                    topology.node(node).kill_node()
            time.sleep(0.2)
        assert info["status"]["phase"] == "succeeded" and struck is not None, info
    published = {v: layout.weights_dir(workdir, v).stat().st_mtime for v in layout.weights_versions(workdir)}
    before = sorted(v for v, at in published.items() if at < struck and v > 0)
    pace = statistics.median(published[v] - published[v - 1] for v in before[1:])
    last = before[-1]
    lost = published[last + AFTER] - published[last] - AFTER * pace
    seen = events(workdir)
    if fault != "drain":
        return lost, {}
    start = min(e["time"] for e in seen if e["kind"] == "node_draining")

    def first(kinds: tuple[str, ...], words: str = "") -> float:
        times = [e["time"] for e in seen if e["kind"] in kinds and words in e["message"]]
        return min(times) - start if times else float("nan")

    return lost, {
        "an engine out of the router": first(("engine_draining",)),
        "the engine stopped (its requests done)": first(("engine_removed", "engine_moved"), "drained"),
        "a replica out of the quorum": first(("replica_left",)),
        "the orchestrator gone after its commit": first(("orchestrator_left",)),
        "the services started elsewhere": first(("services_moved",)),
        "the node empty": first(("node_drained",)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lease-ttl", type=int, default=4, metavar="S", help="the erlds' node lease (default: 4)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-drain-bench-"))
    lost: dict[str, list[float]] = {"drain": [], "kill": []}
    drains = []
    for repeat in range(args.repeats):
        for fault in ("drain", "kill"):
            seconds, moments = run(root / f"{fault}-{repeat}", fault, args.lease_ttl)
            lost[fault].append(seconds)
            if moments:
                drains.append(moments)
            print(f"{fault} {repeat}: {seconds:.1f} s lost", flush=True)
    print("\n| | drained | killed |\n|---|---|---|")
    print(
        f"| time lost (s), each run | {', '.join(f'{s:.1f}' for s in lost['drain'])} "
        f"| {', '.join(f'{s:.1f}' for s in lost['kill'])} |"
    )
    drained, killed = statistics.mean(lost["drain"]), statistics.mean(lost["kill"])
    print(f"| mean (s) | {drained:.1f} | {killed:.1f} |")
    print(f"\ndrain / kill: {drained / killed:.2f} (target: at most 0.20)")
    print("\n| from the drain's start to | " + " | ".join(f"run {i}" for i in range(len(drains))) + " |")
    print("|---|" + "---|" * len(drains))
    for moment in drains[0]:
        print(f"| {moment} | " + " | ".join(f"{d[moment]:.1f} s" for d in drains) + " |")


if __name__ == "__main__":
    main()
