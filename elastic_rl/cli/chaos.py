"""`erl chaos run`: run a chaos scenario against its fault-free reference and report which invariants
held (the chaos harness is imported only when it runs)."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

from elastic_rl.cli.common import EXIT_FAILED, add_command, add_command_group


def cmd_chaos_run(args: argparse.Namespace) -> int:
    from chaos.harness import run_scenario
    from chaos.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    out = args.out or Path("runs") / "chaos" / f"{scenario.name}-{datetime.now():%Y%m%d-%H%M%S}"
    result = run_scenario(scenario, out, args.cache)
    print(f"scenario {scenario.name}: {'passed' if result.passed else 'FAILED'}; ETTR {result.ettr:.3f}")
    for check in result.checks:
        print(f"  {'held' if check.held else 'BROKEN':<6} {check.name}: {check.detail}")
    if result.error:
        print(f"  {result.error}")
    print(f"report: {out / 'report.md'}")
    return 0 if result.passed else EXIT_FAILED


def add_chaos_commands(commands) -> None:
    """`erl chaos` and its subcommand `run`."""
    chaos_commands = add_command_group(
        commands,
        "chaos",
        "run chaos scenarios: faults injected into a real job, every invariant checked",
        "erl chaos run chaos/scenarios/engine-hang.yaml --out runs/chaos/hang",
    )
    chaos_run = add_command(
        chaos_commands,
        "run",
        "run a scenario and its fault-free reference, check the invariants, write the report",
        "erl chaos run chaos/scenarios/engine-hang.yaml --out runs/chaos/hang",
        cmd_chaos_run,
        etcd=False,
    )
    chaos_run.add_argument("scenario", type=Path, help="a scenario file (YAML), e.g. chaos/scenarios/*.yaml")
    chaos_run.add_argument(
        "--out", type=Path, help="where the runs and the report go (default: runs/chaos/<name>-<time>)"
    )
    chaos_run.add_argument("--cache", type=Path, help="fault-free reference runs to reuse (default: runs/.chaos-cache)")
