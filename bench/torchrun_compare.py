"""Benchmark: time lost per kill, elastic-rl's replicas under torchft against torchrun restarting everyone.

    .venv/bin/python bench/torchrun_compare.py

The same training (bench/steps_worker.py: the tiny model's GRPO steps on
synthetic batches, two workers) runs four times: under torchrun
(``torch.distributed.elastic``, ``--max-restarts``, every worker restarting
from the newest snapshot after a death) and as two torchft replicas (a
killed replica restarts cold and heals from the survivor), each once without
faults and once with worker/replica 1 SIGKILLed at the same steps. Time lost
per kill = (faulty wall time - fault-free wall time) / kills, for each.
Target: elastic-rl's <= 1/5 of torchrun's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, free_port  # noqa: E402

WORKER = REPO / "bench" / "steps_worker.py"


def steps_done(workdir: Path, worker: str) -> int:
    path = workdir / f"progress-{worker}"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((int(line.split()[0]) + 1 for line in lines), default=0)


def kill_on_schedule(workdir: Path, watch: str, target_pid_file: str, kills: list[int], on_kill=None) -> None:
    for step in kills:
        while steps_done(workdir, watch) < step:
            time.sleep(0.01)
        os.kill(int((workdir / target_pid_file).read_text()), signal.SIGKILL)
        with open(workdir / "kills", "a") as record:
            record.write(f"{steps_done(workdir, watch)} {time.time()}\n")
        if on_kill is not None:
            on_kill()


def recoveries(workdir: Path, watch: str) -> list[float]:
    """Per kill: from the kill until the watched worker finishes, again, the step after the one it was at,
    less one ordinary step. torchrun's includes the restart and the steps redone since the snapshot."""
    records = [(int(step), float(t)) for step, t in (line.split() for line in (workdir / f"progress-{watch}").open())]
    gaps = sorted(b - a for (_, a), (_, b) in zip(records, records[1:]))
    step_time = gaps[len(gaps) // 2]
    result = []
    for line in (workdir / "kills").read_text().splitlines():
        reached, killed = int(line.split()[0]), float(line.split()[1])
        back = min(t for step, t in records if t > killed and step >= reached)
        result.append(back - killed - step_time)
    return result


def run_torchrun(workdir: Path, steps: int, snapshot_every: int, kills: list[int]) -> float:
    workdir.mkdir(parents=True)
    started = time.monotonic()
    agent = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            str(len(kills) + 1),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--monitor-interval",
            "0.1",
            str(WORKER),
            "torchrun",
            str(workdir),
            str(steps),
            str(snapshot_every),
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kill_on_schedule(workdir, "rank0", "pid-1", kills)
    assert agent.wait(timeout=600) == 0, "torchrun failed"
    return time.monotonic() - started


def run_torchft(workdir: Path, steps: int, kills: list[int], heartbeat_timeout_ms: int, warm: bool) -> float:
    workdir.mkdir(parents=True)
    lighthouse_port = free_port()
    lighthouse = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "torchft_lighthouse"),
            "--min_replicas",
            "1",
            "--bind",
            f"127.0.0.1:{lighthouse_port}",
            "--join_timeout_ms",
            "100",
            "--heartbeat_timeout_ms",
            str(heartbeat_timeout_ms),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def replica(identity: str) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "torchft",
                str(workdir),
                str(steps),
                identity,
                f"http://127.0.0.1:{lighthouse_port}",
                str(free_port()),
            ],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=open(workdir / f"{identity}.log", "ab"),
            stderr=subprocess.STDOUT,
        )

    spares = iter(range(len(kills) + 1))

    def start_spare() -> None:
        replicas.append(replica(f"spare-{next(spares)}"))

    def replace_killed() -> None:
        # erld's part, done here: a warm spare takes the place (and a new one starts), or a cold restart.
        if warm:
            (workdir / f"assign-{len(replicas) - 3}").write_text("1")
            start_spare()
        else:
            replicas.append(replica("1"))

    replicas = [replica("0"), replica("1")]
    if warm:
        start_spare()
        while not (workdir / "progress-replica0").exists():
            time.sleep(0.05)  # the spare is built while the replicas start; time from here
    started = time.monotonic()
    kill_on_schedule(workdir, "replica0", "pid-replica1", kills, on_kill=replace_killed)
    assert replicas[0].wait(timeout=600) == 0, "replica 0 failed"
    elapsed = time.monotonic() - started
    for process in replicas[1:]:
        process.kill()  # the other replica is done or nearly; a spare is still waiting
        process.wait()
    lighthouse.kill()
    lighthouse.wait()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--kills", type=int, nargs="+", default=[15, 40])
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="the lighthouse's (the spec default)")
    parser.add_argument("--warm-spare", action="store_true", help="a killed replica's place goes to a warm spare")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-torchrun-bench-"))
    times = {
        "torchrun_clean_s": run_torchrun(root / "tr-clean", args.steps, args.snapshot_every, []),
        "torchrun_faulty_s": run_torchrun(root / "tr-faulty", args.steps, args.snapshot_every, args.kills),
        "torchft_clean_s": run_torchft(root / "ft-clean", args.steps, [], args.heartbeat_timeout_ms, args.warm_spare),
        "torchft_faulty_s": run_torchft(
            root / "ft-faulty", args.steps, args.kills, args.heartbeat_timeout_ms, args.warm_spare
        ),
    }
    recovered = {
        "torchrun": recoveries(root / "tr-faulty", "rank0"),
        "elastic_rl": recoveries(root / "ft-faulty", "replica0"),
    }
    kills = len(args.kills)
    lost_torchrun = (times["torchrun_faulty_s"] - times["torchrun_clean_s"]) / kills
    lost_torchft = (times["torchft_faulty_s"] - times["torchft_clean_s"]) / kills
    report = {
        **{k: round(v, 2) for k, v in times.items()},
        "steps": args.steps,
        "snapshot_every": args.snapshot_every,
        "kills_at": args.kills,
        "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
        "warm_spare": args.warm_spare,
        "lost_per_kill_torchrun_s": round(lost_torchrun, 2),
        "lost_per_kill_elastic_rl_s": round(lost_torchft, 2),
        "ratio": round(lost_torchft / lost_torchrun, 3),
        "recovery_per_kill_torchrun_s": [round(r, 2) for r in recovered["torchrun"]],
        "recovery_per_kill_elastic_rl_s": [round(r, 2) for r in recovered["elastic_rl"]],
        "recovery_ratio": round(sum(recovered["elastic_rl"]) / sum(recovered["torchrun"]), 3),
    }
    print(orjson.dumps(report).decode(), flush=True)


if __name__ == "__main__":
    main()
