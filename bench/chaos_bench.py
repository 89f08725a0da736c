"""Benchmark: the ETTR and the time each fault costs, for chaos scenarios.

    .venv/bin/python bench/chaos_bench.py                                   # the library, chaos/scenarios/
    .venv/bin/python bench/chaos_bench.py bench/scenarios/one-fault-a-minute.yaml

Runs each scenario with `chaos.harness.run_scenario` (its fault-free reference
from the cache when there is one) and prints one markdown row per scenario
and one per fault: the ETTR (fault-free wall time over faulty wall time), and
per fault the time to detect it, the time until the job trained its next
rollout, the time lost and the steps redone. Reports stay in
runs/chaos-bench/<scenario>/.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chaos.harness import run_scenario  # noqa: E402
from chaos.scenario import load_scenario  # noqa: E402


def show(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted((REPO / "chaos" / "scenarios").glob("*.yaml"))
    print(
        "| scenario | passed | ETTR | fault-free (s) | with faults (s) | fault | detected (s) | next rollout (s) "
        "| lost (s) | steps redone |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        scenario = load_scenario(path)
        result = run_scenario(scenario, REPO / "runs" / "chaos-bench" / scenario.name)
        head = (
            f"| {scenario.name} | {'yes' if result.passed else 'NO'} | {result.ettr:.3f} | "
            f"{result.reference_wall_s:.1f} | {result.faulty_wall_s:.1f} |"
        )
        for index, fault in enumerate(result.faults or [None]):
            prefix = head if index == 0 else "| | | | | |"
            if fault is None:
                print(f"{prefix} {result.error} | | | | |")
                continue
            print(
                f"{prefix} {fault.kind} {fault.target} | {show(fault.detection_s)} | {show(fault.progress_s)} | "
                f"{fault.time_lost_s:.2f} | {fault.steps_redone} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
