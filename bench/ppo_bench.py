"""Benchmark: PPO with a critic against GRPO, on the tiny copy task and on the SmolLM2 math job.

    .venv/bin/python bench/ppo_bench.py                        # both parts
    .venv/bin/python bench/ppo_bench.py --seeds 3 --tiny-rollouts 40 --smollm2-rollouts 3

The tiny part runs examples/tiny-grpo.yaml for --tiny-rollouts rollouts, once per seed and
estimator, one job after another under one erld, and prints per run the wall time, the mean reward
of the first and last 5 rollouts, and the reward gained per minute (their difference over the wall
time from the job's start to its last rollout), then each estimator's mean over the seeds and PPO's
ratio to GRPO. The SmolLM2 part runs examples/smollm2-math.yaml for --smollm2-rollouts rollouts with
each estimator and prints the mean optimizer step time, the rollout's prepare time (the old-policy
pass, and with PPO the critic's values) and its whole training time: what the critic costs a step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, SPEC, finished, running_daemon, submit  # noqa: E402

SMOLLM2 = REPO / "examples" / "smollm2-math.yaml"
ESTIMATORS = ("grpo", "ppo")
WINDOW = 5


def run_job(endpoint: str, spec: Path, name: str, workdir: Path, overrides: list[str]) -> list[dict]:
    """The job's metric lines, one per rollout, each with ``minutes`` since its start."""
    submit(endpoint, spec, name, workdir, overrides)
    return finished(endpoint, name, workdir)


def tiny(endpoint: str, root: Path, seeds: int, rollouts: int) -> None:
    print("| estimator | seed | minutes | mean reward, first 5 | mean reward, last 5 | reward gained per minute |")
    print("|---|---|---|---|---|---|")
    gains: dict[str, list[float]] = {estimator: [] for estimator in ESTIMATORS}
    for seed in range(1234, 1234 + seeds):
        for estimator in ESTIMATORS:
            name = f"tiny-{estimator}-{seed}"
            overrides = [
                f"seed={seed}",
                f"rollout.num_rollouts={rollouts}",
                f"algorithm.advantage_estimator={estimator}",
            ]
            lines = run_job(endpoint, SPEC, name, root / name, overrides)
            rewards = [line["rollout/reward_mean"] for line in lines]
            first, last, minutes = mean(rewards[:WINDOW]), mean(rewards[-WINDOW:]), lines[-1]["minutes"]
            gains[estimator].append((last - first) / minutes)
            print(
                f"| {estimator} | {seed} | {minutes:.2f} | {first:.3f} | {last:.3f} | {gains[estimator][-1]:.3f} |",
                flush=True,
            )
    print()
    for estimator in ESTIMATORS:
        print(f"{estimator}: mean reward gained per minute over {seeds} seeds {mean(gains[estimator]):.3f}")
    print(f"PPO / GRPO: {mean(gains['ppo']) / mean(gains['grpo']):.2f}\n", flush=True)


def smollm2(endpoint: str, root: Path, rollouts: int) -> None:
    print("| estimator | optimizer step | prepare (old policy, values) | training per rollout |")
    print("|---|---|---|---|")
    steps = {}
    for estimator in ESTIMATORS:
        name = f"smollm2-{estimator}"
        overrides = [f"rollout.num_rollouts={rollouts}", f"algorithm.advantage_estimator={estimator}"]
        lines = run_job(endpoint, SMOLLM2, name, root / name, overrides)
        steps[estimator] = mean(line["train/step_time"] for line in lines)
        prepare = mean(line["train/prepare_time"] for line in lines)
        training = mean(line["train/rollout_train_time"] for line in lines)
        print(f"| {estimator} | {steps[estimator]:.2f} s | {prepare:.2f} s | {training:.2f} s |", flush=True)
    print(f"\nPPO's step / GRPO's: {steps['ppo'] / steps['grpo']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tiny-rollouts", type=int, default=40)
    parser.add_argument("--smollm2-rollouts", type=int, default=3, help="0 skips the SmolLM2 part")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-ppo-bench-"))
    with running_daemon(root, cpu_devices=4) as endpoint:
        if args.seeds:
            tiny(endpoint, root, args.seeds, args.tiny_rollouts)
        if args.smollm2_rollouts:
            smollm2(endpoint, root, args.smollm2_rollouts)


if __name__ == "__main__":
    main()
