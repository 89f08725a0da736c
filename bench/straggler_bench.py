"""Step time with one trainer replica at a quarter of its speed: before the straggler rule finds it, once its
replacement is back in the quorum, and with no mitigation (``fault_tolerance.straggler_factor: null``), as
ratios to the same run's steps before the fault.

    .venv/bin/python bench/straggler_bench.py --out straggler.json

Both runs are the chaos scenario ``chaos/scenarios/slow-trainer.yaml`` (the tiny job, two replicas, replica 1
SIGSTOPped 30 ms of every 40 ms from rollout 3 on), run by the chaos harness with its fault-free reference
and every invariant checked. The step time is the exporting replica's ``train/step_time`` per rollout: its
forward and backward passes and its wait in the all-reduce for the slowest replica. Prints a markdown table
and writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import median

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chaos.harness import run_scenario  # noqa: E402
from chaos.scenario import load_scenario  # noqa: E402
from checkpoints import layout  # noqa: E402

SCENARIO = REPO / "chaos" / "scenarios" / "slow-trainer.yaml"


def phases(workdir: Path, fault_at: float) -> dict[str, float | None]:
    """The median step time of each phase of one run, and the moments that divide them."""
    events = layout.read_lines(layout.events_path(workdir))
    lines = layout.read_lines(layout.metrics_lines_path(workdir))
    found = next((e["time"] for e in events if e["kind"] == "replica_straggling"), None)
    # The replacement is back once a quorum holds both replicas again.
    rejoined = [e for e in events if e["kind"] == "quorum_changed" and e["participants"] == 2]
    healed = next((e["time"] for e in rejoined if found and e["time"] > found), None)

    def step_time(start: float, end: float | None) -> float | None:
        times = [line["train/step_time"] for line in lines if start < line["time"] <= (end or float("inf"))]
        return median(times) if times else None

    return {
        "clean": step_time(0.0, fault_at),
        "slow, before detection": step_time(fault_at, found),
        "after the replacement": None if healed is None else step_time(healed, None),
        "detected_after_s": None if found is None else found - fault_at,
        "back_after_s": None if healed is None else healed - fault_at,
    }


def run(out: Path, cache: Path, *, mitigated: bool) -> dict:
    scenario = load_scenario(SCENARIO)
    if not mitigated:
        overrides = [*scenario.overrides, "fault_tolerance.straggler_factor=null"]
        scenario = scenario.model_copy(update={"overrides": overrides, "expect_events": []})
    result = run_scenario(scenario, out, cache)
    workdir = Path(orjson.loads((out / "report.json").read_bytes())["workdir"])
    (injection,) = result.faults
    started = min(e["time"] for e in layout.read_lines(layout.events_path(workdir)) if e["kind"] == "job_started")
    return {
        "mitigated": mitigated,
        "passed": result.passed,
        "ettr": result.ettr,
        **phases(workdir, started + injection.at_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("straggler_bench.json"))
    parser.add_argument("--cache", type=Path, help="the chaos harness's reference runs (default: a fresh one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        cache = args.cache or Path(folder) / "cache"
        results = [run(Path(folder) / name, cache, mitigated=name == "mitigated") for name in ("mitigated", "none")]
    args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    mitigated, unmitigated = results
    clean = mitigated["clean"]

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s ({value / clean:.2f}x)"

    print("| phase | step time (x clean) |")
    print("|---|---|")
    print(f"| before the fault | {ratio(clean)} |")
    print(f"| one replica at a quarter speed, before detection | {ratio(mitigated['slow, before detection'])} |")
    print(f"| after the replacement | {ratio(mitigated['after the replacement'])} |")
    unmitigated_time = ratio(unmitigated["slow, before detection"])
    print(f"| no mitigation (straggler_factor: null), after the fault | {unmitigated_time} |")
    print(
        f"\ndetected {mitigated['detected_after_s']:.1f} s after the fault, its replacement in the quorum "
        f"{mitigated['back_after_s']:.1f} s after it; ETTR {mitigated['ettr']:.3f} mitigated, "
        f"{unmitigated['ettr']:.3f} without; invariants held: {mitigated['passed']}, {unmitigated['passed']}"
    )


if __name__ == "__main__":
    main()
