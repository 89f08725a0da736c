"""Benchmark: on-policy distillation with the teacher in the trainer against teacher engines, and what a
teacher engine's death costs.

    .venv/bin/python bench/distillation_bench.py                 # 3 repeats of each way
    .venv/bin/python bench/distillation_bench.py --repeats 1
    .venv/bin/python bench/distillation_bench.py --against-grpo  # the reward curves beside GRPO's

First the teacher: the tiny job trained for 30 rollouts. Then students from the tiny job's start, 10
rollouts each on one engine at a constant learning rate, rewarded by tests.rewards:group_copy_rate (no
signal for GRPO: they learn from the teacher alone), one job after another under one erld:

- ``trainer``: the teacher held in the trainer;
- ``engines``: one teacher engine;
- ``engines, killed``: one teacher engine, killed (SIGKILL) as it answers its first request of rollout 3.

Per way it prints the mean over the repeats of the job's wall time (start to its last rollout), the
seconds from a rollout's last sample to the teacher's last score (``rollout/teacher_time``), the
slowest iteration (``perf/iteration_time``: with the kill, the rollout that waits for the teacher's
replacement), the reward of the last rollout and the reverse KL to the teacher at the first and last.

With ``--against-grpo``, three students from the same start as long as the teacher trained (30 rollouts,
one engine, a constant learning rate of 0.01, the teacher in the trainer): GRPO alone, GRPO with
distillation, and distillation alone (tests.rewards:group_copy_rate, as above). It prints their reward
every five rollouts and the first rollout whose reward reached half the teacher's and the teacher's
(the mean of its last five rollouts).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SPEC, finished, job_status, running_daemon, submit  # noqa: E402

ROLLOUTS = 10
GROUPS_PER_ROLLOUT = 32  # the tiny job's prompts per rollout: one scoring request each
KILLED_IN = 3
STUDENT = [
    f"rollout.num_rollouts={ROLLOUTS}",
    "engines.count=1",
    "trainer.lr_decay=constant",
    "rollout.group_reward_function=tests.rewards:group_copy_rate",
]
WAYS = {"trainer": [], "engines": ["algorithm.distillation.engines.count=1"]}
TEACHER_ROLLOUTS = 30
CURVE = ["engines.count=1", "trainer.lr_decay=constant", "trainer.lr=0.01", f"rollout.num_rollouts={TEACHER_ROLLOUTS}"]
TAUGHT = "algorithm.distillation.teacher={teacher}"
STUDENTS = {
    "GRPO": CURVE,
    "GRPO and distillation": [*CURVE, TAUGHT],
    "distillation alone": [*CURVE, TAUGHT, "rollout.group_reward_function=tests.rewards:group_copy_rate"],
}


def teacher_answers(workdir: Path) -> int:
    return sum(log.read_text().count("POST /generate") for log in (workdir / "logs").glob("teacher-*.log"))


def kill_the_teacher(endpoint: str, name: str, workdir: Path) -> None:
    """SIGKILL teacher-0 as it answers its first scoring request of rollout KILLED_IN."""
    while (pid := job_status(endpoint, name)["procs"].get("teacher-0", {}).get("pid")) is None:
        time.sleep(0.1)
    while teacher_answers(workdir) <= KILLED_IN * GROUPS_PER_ROLLOUT:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)


def against_grpo(endpoint: str, root: Path, teacher: list[dict], weights: Path) -> None:
    """The three students' reward curves beside the teacher's last reward (``weights``: its checkpoint)."""
    target = mean(line["rollout/reward_mean"] for line in teacher[-5:])
    marks = list(range(0, TEACHER_ROLLOUTS, 5)) + [TEACHER_ROLLOUTS - 1]
    print(f"teacher: {target:.3f} (the mean of its last five rollouts)")
    print(f"| student | {' | '.join(str(mark + 1) for mark in marks)} | half the teacher's | the teacher's |")
    print("|---" * (len(marks) + 3) + "|")
    for name, overrides in STUDENTS.items():
        workdir = root / name.lower().replace(" ", "-")
        submit(endpoint, SPEC, workdir.name, workdir, [override.format(teacher=weights) for override in overrides])
        rewards = [line["rollout/reward_mean"] for line in finished(endpoint, workdir.name, workdir)]
        reached = [next((i + 1 for i, r in enumerate(rewards) if r >= goal), "-") for goal in (target / 2, target)]
        row = " | ".join(f"{rewards[mark]:.3f}" for mark in marks)
        print(f"| {name} | {row} | {reached[0]} | {reached[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against-grpo", action="store_true", help="the reward curves beside GRPO's instead")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-distillation-bench-"))
    with running_daemon(root, cpu_devices=4) as endpoint:
        submit(
            endpoint, SPEC, "teacher", root / "teacher", [f"rollout.num_rollouts={TEACHER_ROLLOUTS}", "engines.count=1"]
        )
        teacher = finished(endpoint, "teacher", root / "teacher")
        weights = root / "teacher" / "weights" / str(TEACHER_ROLLOUTS)
        if args.against_grpo:
            against_grpo(endpoint, root, teacher, weights)
            return
        taught = [TAUGHT.format(teacher=weights), *STUDENT]
        runs: dict[str, list[list[dict]]] = {way: [] for way in [*WAYS, "engines, killed"]}
        for repeat in range(args.repeats):
            for way, overrides in [*WAYS.items(), ("engines, killed", WAYS["engines"])]:
                name = f"{way.replace(', ', '-')}-{repeat}"
                submit(endpoint, SPEC, name, root / name, [*taught, *overrides])
                if way == "engines, killed":
                    kill_the_teacher(endpoint, name, root / name)
                runs[way].append(finished(endpoint, name, root / name))
    print("| teacher | job wall time | teacher_time | slowest iteration | last reward | reverse KL, first, last |")
    print("|---|---|---|---|---|---|")
    for way, jobs in runs.items():
        wall = mean(lines[-1]["minutes"] * 60 for lines in jobs)
        waits = mean(mean(line.get("rollout/teacher_time", 0.0) for line in lines) for lines in jobs)
        slowest = mean(max(line.get("perf/iteration_time", 0.0) for line in lines) for lines in jobs)
        reward = mean(lines[-1]["rollout/reward_mean"] for lines in jobs)
        kl = (
            mean(lines[0]["train/distillation_reverse_kl"] for lines in jobs),
            mean(lines[-1]["train/distillation_reverse_kl"] for lines in jobs),
        )
        print(f"| {way} | {wall:.1f} s | {waits:.2f} s | {slowest:.2f} s | {reward:.3f} | {kl[0]:.3f}, {kl[1]:.3f} |")


if __name__ == "__main__":
    main()
