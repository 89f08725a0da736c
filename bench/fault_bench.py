"""Benchmark: what a failure inside a running job costs, measured in real jobs under erld.

    .venv/bin/python bench/fault_bench.py
    .venv/bin/python bench/fault_bench.py --set algorithm.advantage_estimator=ppo   # the same, with PPO's critic

Two runs of the tiny GRPO job with two trainer replicas and two engines: one
with no warm spare (a killed replica restarts cold), one with a warm spare.
In each, replica 1 is SIGKILLed twice (the second time after it is back), and
in the first run engine-0 is SIGSTOPped (a hang) and engine-1 SIGKILLed. From
the job's events and the processes' own logs it reports:

- survivors' stall per replica kill: from the survivor's first quorum after
  the kill to its next committed step, next to the heartbeat timeout and the
  median step time (target: stall <= heartbeat timeout + one step);
- rejoin, cold and warm: from erld noticing the death to the new replica
  asking the lighthouse for a quorum ("ready"), and to it being in one
  ("joined": healed from a peer if it was behind; this includes waiting for
  the survivors' next step, which in this job follows the next rollout's
  generation);
- engine failure detection: from the fault to erld's verdict (health-check
  timeout for the hang, process exit for the kill), and until the
  replacement serves (registered with the router), next to interval + timeout.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SPEC, erl, events, job_status, log_lines, running_daemon  # noqa: E402

HEARTBEAT_TIMEOUT_S = 1.0  # the spec default
HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S = 1.0, 3.0  # the spec defaults


def run(
    root: Path, endpoint: str, name: str, warm_spares: int, faults: list[tuple[str, int, int]], overrides: list[str]
) -> tuple[Path, dict]:
    """Run the job, sending each (process, signal, rollout) fault; return the work dir and fault times."""
    workdir = root / name
    sets = [arg for override in overrides for arg in ("--set", override)]
    erl(
        "submit",
        str(SPEC),
        "--set",
        "rollout.num_rollouts=24",
        "--set",
        "trainer.replicas=2",
        "--set",
        f"fault_tolerance.warm_spares={warm_spares}",
        "--set",
        "checkpoints.interval_rollouts=4",
        *sets,
        "--workdir",
        str(workdir),
        "--etcd",
        endpoint,
    )
    pending, sent = list(faults), {}
    while (info := job_status(endpoint))["status"]["phase"] in ("pending", "running"):
        if pending and info["progress"].get("rollouts_done", 0) >= pending[0][2]:
            proc, sig, _ = pending[0]
            if info["procs"].get(proc, {}).get("state") == "running":
                # Mid-rollout: a third of the way into the next generation.
                time.sleep(0.5)
                os.kill(info["procs"][proc]["pid"], sig)
                sent[f"{proc}@{pending[0][2]}"] = time.time()
                pending.pop(0)
        time.sleep(0.2)
    assert info["status"]["phase"] == "succeeded", info
    return workdir, sent


def survivor_stalls(workdir: Path, kills: list[float]) -> list[float]:
    lines = log_lines(workdir / "logs" / "trainer-0-0.log")
    stalls = []
    for killed in kills:
        quorum = next(t for t, line in lines if t >= killed and "Start quorum" in line)
        commit = next(t for t, line in lines if t >= quorum and "should_commit=True" in line)
        stalls.append(commit - max(quorum, killed))
    return stalls


def rejoins(workdir: Path) -> list[dict[str, float]]:
    """For each replica-1 death: noticed -> ready (asks for a quorum) -> joined (in a quorum, healed if behind)."""
    deaths = [
        e["time"]
        for e in events(workdir)
        if e["kind"] == "proc_exited" and e["proc"] == "trainer-1-0" and e["exit_code"] < 0  # the SIGKILLs
    ]
    asked, joined = [], []
    for log in sorted((workdir / "logs").glob("*.log")):
        if log.name.startswith(("trainer-1-", "spare-")):
            lines = log_lines(log)
            asked += [t for t, line in lines if "Start quorum" in line]
            joined += [t for t, line in lines if "Finished quorum" in line]
    return [
        {"ready_s": min(t for t in asked if t > death) - death, "joined_s": min(t for t in joined if t > death) - death}
        for death in deaths
    ]


def engine_recovery(workdir: Path, sent: dict[str, float]) -> dict[str, float]:
    found = events(workdir)
    result = {}
    for fault, moment in sent.items():
        proc = fault.split("@")[0]
        if not proc.startswith("engine"):
            continue
        verdict = min(
            e["time"]
            for e in found
            if e.get("proc") == proc and e["kind"] in ("engine_unhealthy", "proc_exited") and e["time"] >= moment
        )
        serving = min(
            e["time"] for e in found if e.get("proc") == proc and e["kind"] == "engine_serving" and e["time"] >= moment
        )
        result[f"{proc}_detect_s"] = verdict - moment
        result[f"{proc}_serving_s"] = serving - moment
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-fault-bench-"))
    faults = [
        ("trainer-1-0", signal.SIGKILL, 4),
        ("engine-0", signal.SIGSTOP, 9),
        ("trainer-1-0", signal.SIGKILL, 14),
        ("engine-1", signal.SIGKILL, 19),
    ]
    with running_daemon(root, cpu_devices=6) as endpoint:
        for name, spares, schedule in (
            ("cold", 0, faults),
            ("warm", 1, [f for f in faults if f[0].startswith("trainer")]),
        ):
            workdir, sent = run(root, endpoint, name, spares, schedule, args.overrides)
            step = median(
                orjson.loads(line)["train/step_time"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
            )
            kills = [moment for fault, moment in sent.items() if fault.startswith("trainer")]
            stalls = survivor_stalls(workdir, kills)
            report = {
                "run": name,
                "median_step_s": round(step, 4),
                "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                "stalls_s": [round(s, 3) for s in stalls],
                "stall_over_step": [round(s / step, 1) for s in stalls],
                "stall_target_s": HEARTBEAT_TIMEOUT_S + step,
                "rejoins": [{k: round(v, 3) for k, v in r.items()} for r in rejoins(workdir)],
                **{k: round(v, 3) for k, v in engine_recovery(workdir, sent).items()},
                "engine_detect_target_s": HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S,
            }
            print(orjson.dumps(report).decode(), flush=True)


if __name__ == "__main__":
    main()
