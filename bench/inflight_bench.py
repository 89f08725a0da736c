"""Benchmark: what an engine's and an orchestrator's death cost with generations continued from their
prefix, against the same faults with continuation off (rollout.continue_inflight=false).

    .venv/bin/python bench/inflight_bench.py                 # the tiny model and SmolLM2 (about 25 minutes)
    .venv/bin/python bench/inflight_bench.py --jobs tiny     # the tiny model alone (about 4 minutes)

Each job has long responses (every one runs to max_new_tokens: rollout.ignore_eos) and deterministic
engines. On one erld with its default pool, each job runs three times: without faults, then with
engine-0 SIGKILLed and, later, the orchestrator SIGKILLed, each 40 % into a rollout's generation (by
the fault-free run's generation time), once with continuation and once without. Reported per run,
from the work dir:

- tokens generated per token trained: every engine's own count of the tokens it generated (erld's
  token ledger) over the response tokens of the committed rollouts;
- time lost per fault: how much longer the rollouts around it took than the fault-free median
  (``chaos.report.analyse_faults``);
- the in-flight log's cost: seconds spent persisting over seconds generating.

The figures are ratios within one run of this script: continuation on / off.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos.faults import inject  # noqa: E402
from chaos.report import analyse_faults  # noqa: E402
from chaos.runner import generating, run_job  # noqa: E402
from chaos.scenario import Fault, FaultKind  # noqa: E402
from chaos.topology import Topology  # noqa: E402
from checkpoints import layout  # noqa: E402
from checkpoints.layout import read_lines  # noqa: E402
from checkpoints.rollout_log import read_rollout  # noqa: E402
from elastic_rl.engines import token_ledger  # noqa: E402
from elastic_rl.spec.loading import load_spec  # noqa: E402

from harness import REPO, SPEC, job_status  # noqa: E402

JOBS = {
    "tiny": (
        SPEC,
        [
            "rollout.num_rollouts=6",
            "rollout.prompts_per_rollout=8",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=400",
            "model.max_position_embeddings=512",
            "trainer.global_batch_size=32",
            "trainer.micro_batch_size=32",
        ],
    ),
    "smollm2": (
        REPO / "examples" / "smollm2-math.yaml",
        [
            "rollout.num_rollouts=5",
            "rollout.prompts_per_rollout=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=128",
            "trainer.cpu_threads=1",
            "checkpoints.interval_rollouts=100",
        ],
    ),
}
COMMON = ["rollout.ignore_eos=true", "rollout.deterministic=true", "checkpoints.keep_last=1000"]
FAULTS = [("engine-0", 1), ("orchestrator", 3)]
INTO_GENERATION = 0.4


def kill_later(topology: Topology, job: str, workdir: Path, proc: str, delay_s: float) -> Callable[[], None]:
    def kill() -> None:
        time.sleep(delay_s)
        info = job_status(topology.endpoint, job)
        inject(Fault(kind=FaultKind.KILL, target=proc), topology, info, workdir, random.Random(0))

    kill.__name__ = f"kill {proc}"
    return kill


def trained_tokens(workdir: Path) -> int:
    return sum(int(read_rollout(workdir, r)[0].response_lengths.sum()) for r in layout.committed_rollouts(workdir))


def measure(topology: Topology, spec: Path, overrides: list[str], workdir: Path, delay_s: float | None) -> dict:
    job = load_spec(spec).name
    faults = []
    if delay_s is not None:
        faults = [(kill_later(topology, job, workdir, proc, delay_s), generating(r)) for proc, r in FAULTS]
    run = run_job(topology, spec, workdir, overrides, faults, timeout_s=1800)
    lines = read_lines(layout.metrics_lines_path(workdir))
    generated, trained = token_ledger.total(workdir), trained_tokens(workdir)
    figures = {
        "generated": generated,
        "trained": trained,
        "per_trained": generated / trained,
        "generation_s": statistics.median(line["rollout/time"] for line in lines),
        "persist_share": sum(line["rollout/inflight_persist_time"] for line in lines)
        / sum(line["rollout/time"] for line in lines),
        "regenerated": sum(line["rollout/regenerated_tokens"] for line in lines),
        "resumed": sum(line["rollout/resumed_tokens"] for line in lines),
    }
    if delay_s is not None:
        figures["lost"] = [report.time_lost_s for report in analyse_faults(run, workdir, workdir.parent / "clean")]
    return figures


def bench(name: str, root: Path) -> None:
    spec, overrides = JOBS[name]
    overrides = overrides + COMMON
    with Topology.single(root / f"erld-{name}", cpu_devices=4) as topology:
        clean = measure(topology, spec, overrides, root / name / "clean", None)
        delay = INTO_GENERATION * clean["generation_s"]
        runs = {"clean": clean}
        for mode, flag in (("continued", "true"), ("started over", "false")):
            workdir = root / name / mode.replace(" ", "-")
            runs[mode] = measure(topology, spec, [*overrides, f"rollout.continue_inflight={flag}"], workdir, delay)
    print(f"\n{name}: faults {FAULTS} (kill, rollout), {INTO_GENERATION:.0%} into its generation ({delay:.2f} s)")
    print("| run | tokens generated | trained | generated / trained | lost: engine-0, orchestrator (s) | persist |")
    print("|---|---|---|---|---|---|")
    for mode, figures in runs.items():
        lost = ", ".join(f"{s:.2f}" for s in figures.get("lost", [])) or "-"
        print(
            f"| {mode} | {figures['generated']} | {figures['trained']} | {figures['per_trained']:.3f} | {lost} "
            f"| {figures['persist_share']:.2%} |"
        )
    on, off = runs["continued"], runs["started over"]
    extra_on, extra_off = on["generated"] - clean["generated"], off["generated"] - clean["generated"]
    print(f"tokens generated beyond the fault-free run's: continued {extra_on}, started over {extra_off}")
    print(f"regenerated tokens the orchestrator saw: continued {on['regenerated']}, started over {off['regenerated']}")
    print(f"tokens a restarted orchestrator took from the in-flight log: continued {on['resumed']}")
    ratios = [a / b if b else float("nan") for a, b in zip(on["lost"], off["lost"])]
    print(f"time lost per fault, continued / started over: engine-0 {ratios[0]:.2f}, orchestrator {ratios[1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=["tiny", "smollm2"])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-inflight-bench-"))
    print(f"work dirs under {root}")
    for name in args.jobs:
        bench(name, root)


if __name__ == "__main__":
    main()
