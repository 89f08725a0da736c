"""Benchmark: sync against async rollouts (wall time per rollout), and what dynamic sampling
generates against what it trains.

    .venv/bin/python bench/rollout_modes_bench.py      # about 4 minutes

Runs examples/tiny-grpo.yaml for 20 rollouts once per variant, one job after another under one
erld, and prints for each the median wall time between two trained rollouts (from metrics.jsonl,
after the first 2), its ratio to sync's, the samples generated per sample trained, and the
generated samples never trained: dropped by the filter, or left in the buffer at the end.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SPEC, erl, job_status, running_daemon  # noqa: E402

ROLLOUTS = 20
VARIANTS = {
    "sync": [],
    "async, max_staleness 1": ["rollout.mode=async", "rollout.max_staleness=1"],
    "async, max_staleness 2": ["rollout.mode=async", "rollout.max_staleness=2"],
    "sync, zero_std, over-sampling 48": ["rollout.dynamic_filter=zero_std", "rollout.over_sampling_batch_size=48"],
}


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="erl-rollout-modes-bench-"))
    print(
        "| variant | s per rollout | against sync | samples generated per sample trained | generated, never trained |"
    )
    print("|---|---|---|---|---|")
    sync_gap = None
    with running_daemon(root, cpu_devices=4) as endpoint:
        for number, (variant, overrides) in enumerate(VARIANTS.items()):
            name, workdir = f"tiny-{number}", root / str(number)
            sets = [
                arg for o in [f"name={name}", f"rollout.num_rollouts={ROLLOUTS}", *overrides] for arg in ("--set", o)
            ]
            erl("submit", str(SPEC), *sets, "--workdir", str(workdir), "--etcd", endpoint)
            while (phase := job_status(endpoint, name)["status"]["phase"]) not in ("succeeded", "failed"):
                time.sleep(1)
            assert phase == "succeeded", job_status(endpoint, name)
            lines = [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
            gap = median(b["time"] - a["time"] for a, b in zip(lines[2:], lines[3:]))
            sync_gap = sync_gap or gap
            generated = sum(line["rollout/samples_generated"] for line in lines)
            used = sum(line["rollout/samples_used"] for line in lines)
            left = (
                lines[-1]["rollout/buffered_groups"]
                * orjson.loads((workdir / "spec.json").read_bytes())["rollout"]["n_samples_per_prompt"]
            )
            print(
                f"| {variant} | {gap:.2f} | {gap / sync_gap:.2f} | {generated / used:.2f} | "
                f"{(generated - used) / generated:.1%} ({left:.0f} still buffered) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
