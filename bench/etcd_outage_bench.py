"""The time an etcd outage costs a running job: the tiny job on one erld over a one-member etcd, the
member frozen (SIGSTOP) for each outage once 4 rollouts are trained, then thawed.

    .venv/bin/python bench/etcd_outage_bench.py --outages 30 120 --out outage.json

Each outage runs on its own fresh cluster, after one fault-free run; the time lost is the run's wall
time (from `job_started` to `job_succeeded`) less the fault-free run's. Also counted: job processes
replaced (a new pid at the end) and rollouts trained again. Run it
in a worktree of an older commit (copy this file there) to compare that commit's behaviour. Prints a
markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import orjson

from harness import SPEC, Topology, erl, events, job_status

ROLLOUTS = 16
FAULT_AT = 4
LEASE_TTL_S = 10  # erld's default


def run(root: Path, outage_s: float) -> dict:
    topology = Topology.cluster(root, nodes=1, cpu_devices=8, etcd_members=1, lease_ttl_s=LEASE_TTL_S)
    workdir = root / "job"
    with topology:
        erl("submit", str(SPEC), "--set", f"rollout.num_rollouts={ROLLOUTS}", "--workdir", str(workdir),
            "--etcd", topology.endpoint)  # fmt: skip
        while (before := job_status(topology.endpoint))["progress"].get("rollouts_done", 0) < FAULT_AT:
            time.sleep(0.2)
        pids = {name: proc["pid"] for name, proc in before["procs"].items()}
        fault_at = time.time()
        if outage_s:
            member = topology.etcd.members[0].process
            member.send_signal(signal.SIGSTOP)
            time.sleep(outage_s)
            member.send_signal(signal.SIGCONT)
        while (after := job_status(topology.endpoint))["status"]["phase"] not in ("succeeded", "failed"):
            time.sleep(0.5)
        seen = events(workdir)
    # A process killed with its node's processes is started again, not restarted: count new pids.
    replaced = sum(1 for name, pid in pids.items() if after["procs"].get(name, {}).get("pid") != pid)
    kinds = Counter(event["kind"] for event in seen if event["time"] >= fault_at)
    started = min(event["time"] for event in seen if event["kind"] == "job_started")
    ended = max(event["time"] for event in seen if event["kind"] == "job_succeeded")
    redone = sum(event.get("redone_rollouts", 0) for event in seen if event["kind"] == "trainer_resumed")
    return {
        "outage_s": outage_s,
        "wall_s": ended - started,
        "processes_replaced": replaced,
        "restarted": kinds["proc_restarted"],
        "rollouts_redone": redone,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outages", type=float, nargs="+", default=[30.0, 120.0])
    parser.add_argument("--out", type=Path, default=Path("etcd_outage_bench.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for index, outage in enumerate([0.0, *args.outages]):
            results.append(run(Path(folder) / f"run-{index}", outage))
            print(orjson.dumps(results[-1]).decode(), flush=True)
    reference = results[0]["wall_s"]
    print(
        "| etcd outage | wall time | time lost | processes replaced | starts after the fault | rollouts trained again |"
    )
    print("|---|---|---|---|---|---|")
    for result in results:
        lost = result["wall_s"] - reference
        print(
            f"| {result['outage_s']:.0f} s | {result['wall_s']:.1f} s | {lost:.1f} s "
            f"| {result['processes_replaced']} | {result['restarted']} | {result['rollouts_redone']} |"
        )
    args.out.write_text(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
