"""Benchmark: a job process restarted from erld's pre-imported interpreters against a cold restart.

    .venv/bin/python bench/pool_bench.py

Two runs of the tiny GRPO job (16 rollouts) on one erld, first with the pool off,
then with one interpreter of each kind. In each, trainer-0-0, engine-0 and the
orchestrator are SIGKILLed in turn, mid-rollout, after rollouts 2, 5 and 8, and
from the events and the processes' own logs it reports, per kind, the time from
the kill to the restarted process being ready:

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
READY = {"trainer-0-0": "Start quorum", "orchestrator": "generating with weights"}
POOLS = {"cold": {"trainer": 0, "orchestrator": 0, "engine": 0}, "pool": {"trainer": 1, "orchestrator": 1, "engine": 1}}


def run(root: Path, name: str) -> dict[str, float]:
    """The job with the kills, on an erld with the ``name`` pool; seconds from each kill to ready."""
    with Topology.single(root / f"erld-{name}", cpu_devices=4, pool=POOLS[name]) as topology:
        workdir = root / name
        erl(
            "submit",
            str(SPEC),
            "--set",
            "rollout.num_rollouts=16",
            "--workdir",
            str(workdir),
            "--etcd",
            topology.endpoint,
        )
        pending, killed = list(KILLS), {}
        while (info := job_status(topology.endpoint))["status"]["phase"] in ("pending", "running"):
            if pending and info["progress"].get("rollouts_done", 0) >= pending[0][1]:
                proc = pending[0][0]
                if info["procs"].get(proc, {}).get("state") == "running":
                    time.sleep(0.5)  # into the next rollout
                    os.kill(info["procs"][proc]["pid"], signal.SIGKILL)
                    killed[proc] = time.time()
                    pending.pop(0)
            time.sleep(0.2)
        assert info["status"]["phase"] == "succeeded", info
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
    return ready


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-pool-bench-"))
    results = {name: run(root, name) for name in POOLS}
    print("| process | cold restart to ready (s) | from the pool (s) | pool / cold |")
    print("|---|---|---|---|")
    for proc, _ in KILLS:
        cold, pooled = results["cold"][proc], results["pool"][proc]
        print(f"| {proc} | {cold:.1f} | {pooled:.1f} | {pooled / cold:.2f} |")


if __name__ == "__main__":
    main()
