"""Benchmark: a job process restarted from erld's pre-imported interpreters against a cold restart.

    .venv/bin/python bench/pool_bench.py

Two runs of the tiny GRPO job on one erld, first with the pool off, then with
one interpreter of each kind. In each, trainer-0-0, engine-0 and the
orchestrator are SIGKILLed in turn, mid-rollout, after rollouts 2, 5 and 8;
with the pool, each kill waits until erld's /metrics shows a ready
interpreter of the process's kind (the job's own start took the first ones,
and their replacements import at the lowest priority while the job keeps the
cores busy: how long that takes is reported too). From the events and the
processes' own logs it reports, per kind, the time from the kill to the
restarted process being ready:

- trainer: asking the lighthouse for a quorum (its first "Start quorum");
- orchestrator: generating (its first "generating with weights");
- engine: serving (``engine_serving``: it answered, loaded the current weights and
  is registered with the router).

The ratio pool / cold is the figure (target: at most 1/5); both runs share the
machine, so the ratio is what noise cannot hide.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos.topology import Topology  # noqa: E402

from harness import SPEC, erl, events, job_status, log_lines  # noqa: E402

KILLS = [("trainer-0-0", 2), ("engine-0", 5), ("orchestrator", 8)]
KINDS = {"trainer-0-0": "trainer", "engine-0": "engine", "orchestrator": "orchestrator"}
READY = {"trainer-0-0": "Start quorum", "orchestrator": "generating with weights"}
POOLS = {"cold": {"trainer": 0, "orchestrator": 0, "engine": 0}, "pool": {"trainer": 1, "orchestrator": 1, "engine": 1}}


def run(root: Path, name: str) -> tuple[dict[str, float], dict[str, float]]:
    """The job with the kills, on an erld with the ``name`` pool: seconds from each kill to ready, and
    (with a pool) seconds from the job's start until an interpreter of the killed process's kind was ready."""
    pooled = any(POOLS[name].values())
    with Topology.single(root / f"erld-{name}", cpu_devices=4, pool=POOLS[name], metrics=True) as topology:
        workdir = root / name
        erl(
            "submit",
            str(SPEC),
            "--set",
            "rollout.num_rollouts=60",
            "--workdir",
            str(workdir),
            "--etcd",
            topology.endpoint,
        )
        started = time.time()
        pending, killed, refilled = list(KILLS), {}, {}
        while (info := job_status(topology.endpoint))["status"]["phase"] in ("pending", "running"):
            if pending and info["progress"].get("rollouts_done", 0) >= pending[0][1]:
                proc = pending[0][0]
                kind = KINDS[proc]
                ready = not pooled or topology.nodes[0].ready_interpreters().get(kind, 0) > 0
                if ready and kind not in refilled:
                    refilled[kind] = time.time() - started
                if ready and info["procs"].get(proc, {}).get("state") == "running":
                    time.sleep(0.5)  # into the next rollout
                    os.kill(info["procs"][proc]["pid"], signal.SIGKILL)
                    killed[proc] = time.time()
                    pending.pop(0)
            time.sleep(0.2)
        assert info["status"]["phase"] == "succeeded" and not pending, (info, pending)
    ready = {}
    for proc, moment in killed.items():
        if proc in READY:
            lines = log_lines(workdir / "logs" / f"{proc}.log")
            ready[proc] = min(t for t, line in lines if t > moment and READY[proc] in line) - moment
        else:
            serving = [e["time"] for e in events(workdir) if e.get("proc") == proc and e["kind"] == "engine_serving"]
            ready[proc] = min(t for t in serving if t > moment) - moment
    restarts = [e for e in events(workdir) if e["kind"] == "proc_restarted"]
    assert all(e["from_pool"] == (name == "pool") for e in restarts), restarts
    return ready, refilled


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-pool-bench-"))
    results = {name: run(root, name) for name in POOLS}
    refilled = results["pool"][1]
    print("| process | cold restart to ready (s) | from the pool (s) | pool / cold | pool ready after job start (s) |")
    print("|---|---|---|---|---|")
    for proc, _ in KILLS:
        cold, pooled = results["cold"][0][proc], results["pool"][0][proc]
        print(f"| {proc} | {cold:.1f} | {pooled:.1f} | {pooled / cold:.2f} | {refilled[KINDS[proc]]:.1f} |")


if __name__ == "__main__":
    main()
