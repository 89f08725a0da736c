"""Benchmark: each advantage estimator on the tiny copy task (two-digit answers by default), same seed, side by side.

    .venv/bin/python bench/estimator_bench.py                           # two digits, 80 rollouts
    .venv/bin/python bench/estimator_bench.py --digits 1 --rollouts 40  # the one-digit task

Runs examples/tiny-grpo.yaml on a copy of --digits digits ("37=" answered "37": data.toy_digits)
for --rollouts rollouts once per `algorithm.advantage_estimator`, one job after another under one
erld, and prints for each the first rollout whose mean reward reached 0.5 and 0.8, and the mean
reward of the first and the last 5 rollouts. With one digit the response is one token, and GSPO's
sequence ratio is GRPO's token ratio bit for bit. max_new_tokens is the answer's length: the toy reward counts the
digits repeated in place, so a token after them would earn nothing, and an end-of-sequence among
them loses the digits it cuts off.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SPEC, erl, job_status, running_daemon  # noqa: E402

TARGETS = (0.5, 0.8)
ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits", type=int, default=2, help="the toy copy's answer length")
    parser.add_argument("--rollouts", type=int, default=80)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-estimator-bench-"))
    reached_columns = " | ".join(f"first rollout with mean reward >= {target}" for target in TARGETS)
    print(f"| estimator | {reached_columns} | first 5 | last 5 |")
    print("|---|" + "---|" * len(TARGETS) + "---|---|")
    with running_daemon(root, cpu_devices=4) as endpoint:
        for estimator in ESTIMATORS:
            name, workdir = f"tiny-{estimator.replace('_', '-')}", root / estimator
            erl(
                "submit",
                str(SPEC),
                "--set",
                f"name={name}",
                "--set",
                f"rollout.num_rollouts={args.rollouts}",
                "--set",
                f"data.toy_digits={args.digits}",
                "--set",
                f"rollout.max_new_tokens={args.digits}",
                "--set",
                f"algorithm.advantage_estimator={estimator}",
                "--workdir",
                str(workdir),
                "--etcd",
                endpoint,
            )
            while (phase := job_status(endpoint, name)["status"]["phase"]) not in ("succeeded", "failed"):
                time.sleep(1)
            assert phase == "succeeded", job_status(endpoint, name)
            rewards = [
                orjson.loads(line)["rollout/reward_mean"]
                for line in (workdir / "metrics.jsonl").read_text().splitlines()
            ]
            reached = [
                next((str(i) for i, reward in enumerate(rewards) if reward >= target), "not reached")
                for target in TARGETS
            ]
            print(
                f"| {estimator} | {' | '.join(reached)} | {mean(rewards[:5]):.3f} | {mean(rewards[-5:]):.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
