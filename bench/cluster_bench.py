"""Benchmark: erld as a cluster. What a node's death, the leader's death and a process exit cost in time.

    .venv/bin/python bench/cluster_bench.py             # about 6 minutes

Three erlds on a three-member etcd (lease TTL 4 s), the tiny job with two
replicas and a warm spare, all on this machine. From the job's events:

- node death: a node holding a replica (not the services) is SIGKILLed with
  every process it runs; detection and placement is the lease running out
  (refreshed every TTL/4, so 3/4 TTL to TTL after the death) and the
  controller's next pass writing the new assignments; then start (the moved
  processes started) and ready (engines serving, replicas healed or resumed);
- leader failover: the leader's erld alone is SIGKILLed and not restarted;
  the time until another erld holds the leader key;
- a process exit: an engine SIGKILLed on the leader's node and on another
  node, until its agent restarts it and until it serves again; and a trainer
  replica SIGKILLed with a warm spare waiting elsewhere, until the controller
  promotes the spare and until it has healed into the quorum.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chaos.erl_cli import erl, job_status  # noqa: E402
from chaos.topology import Topology  # noqa: E402

SPEC = REPO / "examples" / "tiny-grpo.yaml"
TTL_S = 4
JOB = [
    "rollout.num_rollouts=60",
    "trainer.replicas=2",
    "fault_tolerance.warm_spares=1",
    "checkpoints.keep_last=1000",
    "fault_tolerance.quorum_timeout_s=20",
]


def events(workdir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]


def first(found: list[dict], after: float, kinds: tuple[str, ...], proc: str | None = None) -> float | None:
    times = [
        e["time"]
        for e in found
        if e["time"] >= after and e["kind"] in kinds and (proc is None or e.get("proc") == proc)
    ]
    return min(times) if times else None


def wait_rollouts(endpoint: str, count: int) -> dict:
    while (info := job_status(endpoint, "tiny-grpo"))["progress"].get("rollouts_done", 0) < count:
        time.sleep(0.2)
    return info


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="erl-cluster-bench-"))
    workdir = root / "job"
    with Topology.cluster(root / "machines", nodes=3, cpu_devices=4, lease_ttl_s=TTL_S) as cluster:
        sets = [a for o in JOB for a in ("--set", o)]
        erl("submit", str(SPEC), *sets, "--workdir", str(workdir), "--etcd", cluster.endpoint, check=True)
        info = wait_rollouts(cluster.endpoint, 3)
        procs, leader = info["procs"], cluster.leader()

        # A process exit: an engine on the leader's node, then one elsewhere.
        exits = {}
        for where in ("leader's node", "another node"):
            engine = next(
                n
                for n, p in procs.items()
                if n.startswith("engine") and (p["node"] == leader) == (where == "leader's node")
            )
            killed = time.time()
            os.kill(procs[engine]["pid"], signal.SIGKILL)
            while first(found := events(workdir), killed, ("engine_serving",), engine) is None:
                time.sleep(0.2)
            info = job_status(cluster.endpoint, "tiny-grpo")
            exits[where] = {
                "engine": engine,
                "restarted_s": first(found, killed, ("proc_restarted",), engine) - killed,
                "serving_s": first(found, killed, ("engine_serving",), engine) - killed,
            }
            procs = info["procs"]

        # A replica dies with a warm spare waiting: the controller moves the replica onto the spare.
        killed = time.time()
        os.kill(procs["trainer-1-0"]["pid"], signal.SIGKILL)
        joined = ("replica_healed", "trainer_resumed")
        while (promoted := first(found := events(workdir), killed, ("spare_promoted",))) is None or first(
            found, promoted, joined, "trainer-1-0"
        ) is None:
            time.sleep(0.2)
        healed = first(found, promoted, joined, "trainer-1-0")
        info = job_status(cluster.endpoint, "tiny-grpo")
        spare = {"promoted_s": promoted - killed, "joined_quorum_s": healed - killed}

        # A node holding a replica, not the services, dies with everything it runs.
        procs = info["procs"]
        services = procs["orchestrator"]["node"]
        victim = next(p["node"] for n, p in procs.items() if n.startswith("trainer") and p["node"] != services)
        moved = sorted(n for n, p in procs.items() if p["node"] == victim)
        killed = time.time()
        cluster.node(victim).kill_node()
        wait_rollouts(cluster.endpoint, info["progress"]["rollouts_done"] + 4)
        found = events(workdir)
        placed = first(found, killed, ("replica_moved", "engine_moved", "spare_moved", "spare_promoted"))
        started = max((first(found, placed, ("proc_started",), p) or placed) for p in moved)
        ready = max(
            first(found, placed, ("replica_healed", "trainer_resumed", "engine_serving"), p) or started for p in moved
        )
        node = {
            "node": victim,
            "processes": moved,
            "detected_and_placed_s": placed - killed,
            "ttl_s": TTL_S,
            "started_s": started - placed,
            "ready_s": ready - started,
            "total_s": ready - killed,
        }

        # The leader's erld dies and stays dead.
        leader = cluster.leader()
        killed = time.monotonic()
        cluster.node(leader).kill()
        while cluster.leader() in (None, leader):
            time.sleep(0.05)
        failover = {"old_leader": leader, "new_leader": cluster.leader(), "failover_s": time.monotonic() - killed}
        erl("stop", "tiny-grpo", "--etcd", cluster.endpoint)
    report = {"process_exit": exits, "replica_to_spare": spare, "node_death": node, "leader_failover": failover}
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
