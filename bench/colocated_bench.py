"""Benchmark: colocated against disaggregated placement on SmolLM2, on the same machine in one run.

    .venv/bin/python bench/colocated_bench.py [--rollouts 6]

The SmolLM2 math job, cut to a few prompts a rollout with deterministic engines, three times under
one private erld:

- disaggregated: one engine and one trainer rank, each on a slot of its own (weights by disk);
- colocated, disk: the trainer rank and the engine share a slot and take turns;
- colocated, memory: the same, the engine taking each version from shared memory.

For each: the median time per rollout (``perf/iteration_time``, rollout 1 on), the peak resident
memory of each slot in use (the bench samples every job process's RSS every 0.2 s and adds them up
per slot: the same measure for every placement), and from the job's own metrics the time of each
handover step (release, resume, offload, onload), the wait for a version's weights and their load,
and the colocated job's own per-slot phase peaks. On a CPU slot the trainer has no device to offload
from, so what colocation saves here is the engine's released memory during training, no more.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, erl, job_status, running_daemon  # noqa: E402

SPEC = REPO / "examples" / "smollm2-math.yaml"
JOB = "smollm2-math"
SHORT = [
    "rollout.prompts_per_rollout=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=32",
    "rollout.deterministic=true",
    "data.system_prompt=Answer briefly.",
    "trainer.global_batch_size=16",
    "trainer.micro_batch_size=8",
    "checkpoints.interval_rollouts=100",
]
PLACEMENTS = {
    "disaggregated": ["engines.count=1"],
    "colocated, disk": ["placement=colocated", "engines.count=null"],
    "colocated, memory": ["placement=colocated", "engines.count=null", "engines.weight_sync=memory"],
}
STEPS = {
    "release (s)": "handover/release_time",
    "resume (s)": "handover/resume_time",
    "trainer offload (s)": "train/offload_time",
    "trainer onload (s)": "train/onload_time",
    "wait for the version (s)": "rollout/wait_weights_time",
    "engine's load of it (s)": "rollout/weights_load_time",
    "disk export (s)": "train/export_time",
    "shared-memory copy (s)": "train/memory_publish_time",
}


class SlotSampler:
    """The peak of each slot's summed RSS (a slot's processes: a trainer rank, an engine, or both)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SlotSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                procs = job_status(self.endpoint, JOB)["procs"]
            except Exception:
                continue
            slots: dict[str, int] = {}
            for proc in procs.values():
                if proc.get("device") is None or not proc.get("pid"):
                    continue
                try:
                    rss = psutil.Process(proc["pid"]).memory_info().rss
                except psutil.Error:
                    continue
                slot = f"{proc['node']}/{proc['device']}"
                slots[slot] = slots.get(slot, 0) + rss
            for slot, rss in slots.items():
                self.peaks[slot] = max(self.peaks.get(slot, 0), rss)


def run(root: Path, overrides: list[str], rollouts: int) -> tuple[list[dict], dict[str, int]]:
    workdir = root / "job"
    sets = [arg for override in [*SHORT, f"rollout.num_rollouts={rollouts}", *overrides] for arg in ("--set", override)]
    with running_daemon(root, cpu_devices=4) as endpoint:
        erl("submit", str(SPEC), *sets, "--workdir", str(workdir), "--etcd", endpoint)
        with SlotSampler(endpoint) as sampler:
            while (phase := job_status(endpoint, JOB)["status"]["phase"]) in ("pending", "running"):
                time.sleep(0.5)
        assert phase == "succeeded", job_status(endpoint, JOB)
    lines = [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_bytes().splitlines()]
    return lines, sampler.peaks


def middle(lines: list[dict], key: str) -> str:
    values = [line[key] for line in lines[1:] if key in line]
    return f"{median(values):.3f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=6)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-colocated-bench-"))
    results = {}
    for index, (name, overrides) in enumerate(PLACEMENTS.items()):
        results[name] = run(root / str(index), overrides, args.rollouts)
    names = list(results)
    print(f"| | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(names)}")
    base = median(line["perf/iteration_time"] for line in results[names[0]][0][1:])
    cells = []
    for name in names:
        time_per_rollout = median(line["perf/iteration_time"] for line in results[name][0][1:])
        cells.append(f"{time_per_rollout:.2f} ({time_per_rollout / base:.2f}x)")
    print(f"| time per rollout, median (s) | {' | '.join(cells)} |")
    print(f"| slots in use | {' | '.join(str(len(results[n][1])) for n in names)} |")
    for what, pick in (("peak of the largest slot (MB)", max), ("sum of the slots' peaks (MB)", sum)):
        print(f"| {what} | {' | '.join(f'{pick(results[n][1].values()) / 1e6:.0f}' for n in names)} |")
    for label, key in STEPS.items():
        print(f"| {label}, median | {' | '.join(middle(results[n][0], key) for n in names)} |")
    for name in names[1:]:
        last = results[name][0][-2]  # the last whose engines resumed after training (its training peak is whole)
        phases = {k: v / 1e6 for k, v in last.items() if k.startswith("memory/")}
        print(f"\n{name}, the job's own telemetry (rollout {last['rollout']}, MB): {orjson.dumps(phases).decode()}")


if __name__ == "__main__":
    main()
