"""Benchmark: how long a job takes to grow into a node that joins mid-run.

    .venv/bin/python bench/elastic_bench.py

The tiny GRPO job with `trainer.replicas: {min: 1, max: 2}` and `engines.count: {min: 2, max: 3}`
starts on one erld whose three slots hold its minimum (two engines, one replica). Once 3 rollouts
are trained a second erld joins with two slots, and the job grows a replica and an engine into it.
From the events it reports the time from the new erld's start to:

- the controller's decision (``replica_added``, ``engine_added``);
- the added replica in the quorum (the first ``quorum_changed`` with 2 participants: it started,
  healed from its peer and stepped with it);
- the added engine serving (``engine_serving`` of engine-2: it answered, loaded the current weights
  and is registered with the router).

Twice: the new erld with no pre-imported interpreters (cold starts) and with erld's default pool,
whose interpreters it imports as it joins; the job has its own node's processes either way.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos.topology import Topology  # noqa: E402

from harness import SPEC, erl, events, job_status  # noqa: E402

COLD = {"trainer": 0, "orchestrator": 0, "engine": 0}
JOIN_AFTER = 3  # rollouts


def run(root: Path, joiner_pool: dict[str, int] | None) -> dict[str, float]:
    """Seconds from the new erld's start to each moment of the growth."""
    with Topology.single(root / "erld", cpu_devices=3, pool=COLD) as topology:
        workdir = root / "job"
        erl(
            "submit",
            str(SPEC),
            "--set",
            "rollout.num_rollouts=40",
            "--set",
            "trainer.replicas={min: 1, max: 2}",
            "--set",
            "engines.count={min: 2, max: 3}",
            "--workdir",
            str(workdir),
            "--etcd",
            topology.endpoint,
        )
        joined = None
        while (info := job_status(topology.endpoint))["status"]["phase"] in ("pending", "running"):
            if joined is None and info["progress"].get("rollouts_done", 0) >= JOIN_AFTER:
                joined = time.time()
                topology.join(2, pool=joiner_pool)
            time.sleep(0.2)
        assert info["status"]["phase"] == "succeeded" and joined is not None, info
    seen = events(workdir)

    def first(kind: str, **fields) -> float:
        times = [e["time"] for e in seen if e["kind"] == kind and all(e.get(k) == v for k, v in fields.items())]
        return min(times) - joined

    return {
        "replica added": first("replica_added", group="replica-1"),
        "engine added": first("engine_added", group="engine-2"),
        "replica in the quorum": first("quorum_changed", participants=2),
        "engine serving": first("engine_serving", proc="engine-2"),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-elastic-bench-"))
    results = {"cold": run(root / "cold", COLD), "pool": run(root / "pool", None)}
    print("| from the new erld's start to | cold (s) | with its pool (s) |")
    print("|---|---|---|")
    for moment in results["cold"]:
        print(f"| {moment} | {results['cold'][moment]:.1f} | {results['pool'][moment]:.1f} |")


if __name__ == "__main__":
    main()
