"""Benchmark: PPO with a critic against GRPO, on the tiny copy task and on the SmolLM2 math job.

    .venv/bin/python bench/ppo_bench.py                        # both parts
    .venv/bin/python bench/ppo_bench.py --seeds 3 --tiny-rollouts 40 --smollm2-rollouts 3
    .venv/bin/python bench/ppo_bench.py --seeds 0 --smollm2-rollouts 0 --smollm2-minutes 12 --smollm2-seeds 3

The tiny part runs examples/tiny-grpo.yaml for --tiny-rollouts rollouts, once per seed and
estimator, one job after another under one erld, and prints per run the wall time, the mean reward
of the first and last 5 rollouts, and the reward gained per minute (their difference over the wall
time from the job's start to its last rollout), then each estimator's mean over the seeds and PPO's
ratio to GRPO. The SmolLM2 part runs examples/smollm2-math.yaml for --smollm2-rollouts rollouts with
each estimator and prints the mean optimizer step time, the rollout's prepare time (the old-policy
pass, and with PPO the critic's values) and its whole training time: what the critic costs a step.
The SmolLM2 reward part (--smollm2-minutes, off by default) runs the same job once per seed and
estimator for that many minutes of wall time each and prints per run the rollouts finished, the mean
reward of the first and last 3 and the reward gained per minute, each estimator's mean reward over the
seeds by stretch of wall time (the curve), and PPO's ratio of reward gained per minute to GRPO's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, SPEC, finished, running_daemon, stopped_after, submit  # noqa: E402

SMOLLM2 = REPO / "examples" / "smollm2-math.yaml"
ESTIMATORS = ("grpo", "ppo")
WINDOW = 5
STRETCH = 3.0  # minutes of wall time per point of the SmolLM2 reward curve
SMOLLM2_WINDOW = 3  # a SmolLM2 PPO rollout takes about 80 s: a short budget holds few


def run_job(endpoint: str, spec: Path, name: str, workdir: Path, overrides: list[str]) -> list[dict]:
    """The job's metric lines, one per rollout, each with ``minutes`` since its start."""
    submit(endpoint, spec, name, workdir, overrides)
    return finished(endpoint, name, workdir)


def gained_per_minute(lines: list[dict], window: int = WINDOW) -> tuple[float, float, float]:
    """The mean reward of the first and the last ``window`` rollouts, and their difference per minute of
    wall time from the job's start to its last rollout."""
    rewards = [line["rollout/reward_mean"] for line in lines]
    first, last = mean(rewards[:window]), mean(rewards[-window:])
    return first, last, (last - first) / lines[-1]["minutes"]


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
            first, last, gain = gained_per_minute(lines)
            gains[estimator].append(gain)
            minutes = lines[-1]["minutes"]
            print(f"| {estimator} | {seed} | {minutes:.2f} | {first:.3f} | {last:.3f} | {gain:.3f} |", flush=True)
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


def smollm2_reward(endpoint: str, root: Path, seeds: int, minutes: float) -> None:
    print(
        f"| estimator | seed | rollouts | mean reward, first {SMOLLM2_WINDOW} | mean reward, last {SMOLLM2_WINDOW} "
        "| reward gained per minute |"
    )
    print("|---|---|---|---|---|---|")
    runs: dict[str, list[list[dict]]] = {estimator: [] for estimator in ESTIMATORS}
    for seed in range(1234, 1234 + seeds):
        for estimator in ESTIMATORS:
            name = f"smollm2-{estimator}-{seed}"
            overrides = [f"seed={seed}", f"algorithm.advantage_estimator={estimator}"]
            lines = stopped_after(endpoint, SMOLLM2, name, root / name, overrides, minutes)
            runs[estimator].append(lines)
            first, last, gain = gained_per_minute(lines, SMOLLM2_WINDOW)
            print(f"| {estimator} | {seed} | {len(lines)} | {first:.3f} | {last:.3f} | {gain:.3f} |", flush=True)
    stretches = int(minutes // STRETCH)
    print("\n| minutes | " + " | ".join(f"{estimator}: mean reward" for estimator in ESTIMATORS) + " |")
    print("|---|" + "---|" * len(ESTIMATORS))
    for stretch in range(stretches):
        start, end = stretch * STRETCH, (stretch + 1) * STRETCH
        cells = []
        for estimator in ESTIMATORS:
            inside = [
                line["rollout/reward_mean"]
                for lines in runs[estimator]
                for line in lines
                if start <= line["minutes"] < end
            ]
            cells.append(f"{mean(inside):.3f} ({len(inside)})" if inside else "none")
        print(f"| {start:.0f}-{end:.0f} | " + " | ".join(cells) + " |")
    gains = {
        estimator: mean(gained_per_minute(lines, SMOLLM2_WINDOW)[2] for lines in runs[estimator])
        for estimator in ESTIMATORS
    }
    for estimator in ESTIMATORS:
        print(f"{estimator}: mean reward gained per minute over {seeds} seeds {gains[estimator]:.4f}")
    print(f"PPO / GRPO: {gains['ppo'] / gains['grpo']:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the tiny task; 0 skips it")
    parser.add_argument("--smollm2-seeds", type=int, default=3)
    parser.add_argument("--tiny-rollouts", type=int, default=40)
    parser.add_argument("--smollm2-rollouts", type=int, default=3, help="0 skips the SmolLM2 step times")
    parser.add_argument(
        "--smollm2-minutes", type=float, default=0.0, help="wall time of each SmolLM2 reward run; 0 skips them"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-ppo-bench-"))
    with running_daemon(root, cpu_devices=4) as endpoint:
        if args.seeds:
            tiny(endpoint, root, args.seeds, args.tiny_rollouts)
        if args.smollm2_rollouts:
            smollm2(endpoint, root, args.smollm2_rollouts)
        if args.smollm2_minutes:
            smollm2_reward(endpoint, root, args.smollm2_seeds, args.smollm2_minutes)


if __name__ == "__main__":
    main()
