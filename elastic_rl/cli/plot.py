"""`erl plot`: draw a job's curves and events as a PNG (the plotting code is imported only when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from elastic_rl import jobs
from elastic_rl.cli.common import add_command, endpoint
from elastic_rl.errors import ElasticRLError
from elastic_rl.store.client import Store


async def cmd_plot(args: argparse.Namespace) -> int:
    from elastic_rl.plot import plot_run

    async with Store(endpoint(args), attempts=1) as store:
        info = await jobs.describe(store, args.job, events=0)
    workdir = Path(info["status"]["workdir"])
    try:
        out = plot_run(workdir, args.output or workdir / "plot.png", f"job {args.job} ({info['status']['phase']})")
    except ValueError as exc:
        raise ElasticRLError(str(exc)) from None
    print(f"wrote {out}")
    return 0


def add_plot_command(commands) -> None:
    """`erl plot`."""
    plot = add_command(
        commands,
        "plot",
        "draw a job's reward, entropy and response length, with its events, as a PNG",
        "erl plot tiny-grpo -o tiny.png",
        cmd_plot,
    )
    plot.add_argument("job")
    plot.add_argument("-o", "--output", type=Path, help="the PNG to write (default: <workdir>/plot.png)")
