"""Benchmark: each advantage estimator on the tiny task with two-digit answers, same seed, side by side.

    .venv/bin/python bench/estimator_bench.py

Runs examples/tiny-grpo.yaml on a two-digit copy ("37=" answered "37": data.toy_digits 2) for
60 rollouts once per `algorithm.advantage_estimator`, one job after another under one erld, and
prints for each the first rollout whose mean reward reached 0.8, and the mean reward of the first
and the last 5 rollouts. With one digit the response is one token, and GSPO's sequence ratio is
GRPO's token ratio bit for bit. max_new_tokens is the answer's length: the toy reward counts the
digits repeated in place, so a token after them would earn nothing, and an end-of-sequence among
them loses the digits it cuts off.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SPEC, erl, job_status, running_daemon  # noqa: E402

ROLLOUTS = 60
TARGET = 0.8
DIGITS = 2
ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="erl-estimator-bench-"))
    print(f"| estimator | first rollout with mean reward >= {TARGET} | first 5 | last 5 |")
    print("|---|---|---|---|")
    with running_daemon(root, cpu_devices=4) as endpoint:
        for estimator in ESTIMATORS:
            name, workdir = f"tiny-{estimator.replace('_', '-')}", root / estimator
            erl("submit", str(SPEC), "--set", f"name={name}", "--set", f"rollout.num_rollouts={ROLLOUTS}",
                "--set", f"data.toy_digits={DIGITS}", "--set", f"rollout.max_new_tokens={DIGITS}",
                "--set", f"algorithm.advantage_estimator={estimator}", "--workdir", str(workdir), "--etcd", endpoint)  # fmt: skip
            while (phase := job_status(endpoint, name)["status"]["phase"]) not in ("succeeded", "failed"):
                time.sleep(1)
            assert phase == "succeeded", job_status(endpoint, name)
            rewards = [orjson.loads(line)["rollout/reward_mean"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
            reached = next((i for i, reward in enumerate(rewards) if reward >= TARGET), None)
            print(f"| {estimator} | {'not reached' if reached is None else reached} | {mean(rewards[:5]):.3f} | "
                  f"{mean(rewards[-5:]):.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
