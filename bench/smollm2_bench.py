"""GRPO on SmolLM2-135M-Instruct with arithmetic word problems, for a fixed wall-clock budget.

    .venv/bin/python bench/smollm2_bench.py                 # 30 minutes, examples/smollm2-math.yaml
    .venv/bin/python bench/smollm2_bench.py --minutes 10 --set trainer.lr=3e-5

Runs the example job under a private erld, stops it (`erl stop`) once the
budget is spent, and reports from the job's own metrics: the reward curve
against wall time, the mean reward of the first and of the last rollouts, the
time split of a rollout (generation, training, weight export, the engines'
weight load, snapshot), the snapshot stall as a fraction of an optimizer step
and the rollout commit as a fraction of a rollout's generation. Results go in
docs/benchmarks/checkpoint-first.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, running_daemon, stopped_after  # noqa: E402

SPEC = REPO / "examples" / "smollm2-math.yaml"
JOB = "smollm2-math"
WINDOW = 5  # rollouts averaged at each end of the curve


def run(root: Path, minutes: float, overrides: list[str]) -> list[dict]:
    with running_daemon(root, cpu_devices=4) as endpoint:
        return stopped_after(endpoint, SPEC, JOB, root / "job", overrides, minutes)


def report(lines: list[dict]) -> None:
    print("rollout  minutes  reward  response_len")
    for line in lines:
        print(
            f"{line['rollout']:7d}  {line['minutes']:7.1f}  {line['rollout/reward_mean']:6.3f}  "
            f"{line['rollout/response_length_mean']:12.1f}"
        )
    rewards = [line["rollout/reward_mean"] for line in lines]
    first, last = mean(rewards[:WINDOW]), mean(rewards[-WINDOW:])
    print(
        f"\n{len(lines)} rollouts; mean reward of the first {WINDOW}: {first:.3f}, of the last {WINDOW}: {last:.3f} "
        f"(rise {last - first:+.3f}; target +0.2)"
    )

    def average(key: str) -> float:
        return mean(line.get(key, 0.0) for line in lines)

    parts = {
        "generation": average("rollout/time"),
        "training": average("train/rollout_train_time"),
        "weight export": average("train/export_time"),
        "engines' weight load": average("rollout/weights_load_time"),
        "snapshot (call)": average("train/snapshot_call_time"),
    }
    print("\nmean time per rollout: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items()))
    snapshots = [line for line in lines if "train/snapshot_call_time" in line]
    stall = [line["train/snapshot_call_time"] + line["train/snapshot_gate_time"] for line in snapshots]
    step = mean(line["train/step_time"] for line in lines)
    if stall:
        print(
            f"snapshot stall: {mean(stall) * 1000:.1f} ms per snapshot over {len(stall)} snapshots = "
            f"{mean(stall) / step:.2%} of a {step:.1f} s optimizer step (target < 2 %)"
        )
    commit = mean(line["rollout/commit_time"] for line in lines if "rollout/commit_time" in line)
    print(
        f"rollout commit: {commit * 1000:.1f} ms = {commit / parts['generation']:.2%} of a rollout's "
        f"generation (target < 5 %)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        report(run(args.keep, args.minutes, args.overrides))
        return
    with tempfile.TemporaryDirectory() as root:
        report(run(Path(root), args.minutes, args.overrides))


if __name__ == "__main__":
    main()
