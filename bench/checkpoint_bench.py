"""Benchmark: what checkpoint-first costs, measured in real jobs under erld.

    .venv/bin/python bench/checkpoint_bench.py            # tiny and ~50M models
    .venv/bin/python bench/checkpoint_bench.py --models tiny

For each model it runs the tiny GRPO job with a snapshot after every rollout,
SIGKILLs the trainer once mid-run, and reports, from the job's own metrics and
logs (ratios within one run, since this machine is noisy):

- snapshot stall: how long the training loop is blocked per snapshot (the save
  call, plus the wait before the next optimizer step if the background copy is
  not done by then), as a fraction of one optimizer step;
- rollout commit: the time to commit a rollout to the log, as a fraction of the
  rollout's generation time;
- resume: from the restarted trainer's process start to its first new step,
  split into imports, setup (model, process groups, quorum), snapshot load and
  replay of the committed rollouts after the snapshot.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SPEC, erl, job_status, running_daemon  # noqa: E402

MODELS = {
    "tiny": [],
    "50m": [
        "--set",
        "model.hidden_size=512",
        "--set",
        "model.num_layers=12",
        "--set",
        "model.num_attention_heads=8",
        "--set",
        "model.num_query_groups=4",
        "--set",
        "model.ffn_hidden_size=2048",
        "--set",
        "rollout.prompts_per_rollout=8",
        "--set",
        "trainer.global_batch_size=128",
        "--set",
        "trainer.micro_batch_size=32",
    ],
}


def run(model: str, rollouts: int, kill_at: int, root: Path, endpoint: str) -> dict[str, float]:
    workdir = root / model
    erl(
        "submit",
        str(SPEC),
        *MODELS[model],
        "--set",
        f"rollout.num_rollouts={rollouts}",
        "--set",
        "checkpoints.interval_rollouts=1",
        "--workdir",
        str(workdir),
        "--etcd",
        endpoint,
    )
    killed = False
    while (info := job_status(endpoint))["status"]["phase"] in ("pending", "running"):
        if not killed and info["progress"].get("rollouts_done", 0) >= kill_at:
            os.kill(info["procs"]["trainer-0-0"]["pid"], signal.SIGKILL)
            killed = True
        time.sleep(0.5)
    assert info["status"]["phase"] == "succeeded", info
    lines = [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]

    def average(key: str) -> float:
        return mean(line[key] for line in lines if key in line)

    def middle(key: str) -> float:
        return median(line[key] for line in lines if key in line)

    events = [orjson.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    (caught_up,) = [e for e in events if e["kind"] == "trainer_caught_up" and e["proc"] == "trainer-0-0"]
    imports, setup, load, replay = (caught_up[key] for key in ("imports_s", "setup_s", "load_s", "replay_s"))
    # Blocked per snapshot: the save call, then the wait before the next optimizer step.
    stall = average("train/snapshot_call_time") + average("train/snapshot_gate_time")
    return {
        "step_time_s": average("train/step_time"),
        "snapshot_stall_s": stall,
        "snapshot_stall_fraction": stall / average("train/step_time"),
        # The mean includes the replay right after the resume, when rollouts arrive back to back.
        "snapshot_stall_median_s": middle("train/snapshot_call_time") + middle("train/snapshot_gate_time"),
        "snapshot_stall_median_fraction": (middle("train/snapshot_call_time") + middle("train/snapshot_gate_time"))
        / middle("train/step_time"),
        "snapshot_call_s": average("train/snapshot_call_time"),
        "snapshot_gate_s": average("train/snapshot_gate_time"),
        "rollout_time_s": average("rollout/time"),
        "commit_time_s": average("rollout/commit_time"),
        "commit_fraction": average("rollout/commit_time") / average("rollout/time"),
        "resume_imports_s": imports,
        "resume_setup_s": setup,
        "resume_snapshot_load_s": load,
        "resume_replay_s": replay,
        "resume_total_s": imports + setup + load + replay,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rollouts", type=int, default=8)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-bench-"))
    with running_daemon(root, cpu_devices=4) as endpoint:
        for model in args.models:
            result = run(model, args.rollouts, kill_at=args.rollouts // 2, root=root, endpoint=endpoint)
            print(orjson.dumps({"model": model, **{k: round(v, 4) for k, v in result.items()}}).decode(), flush=True)


if __name__ == "__main__":
    main()
