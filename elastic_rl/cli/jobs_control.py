"""`erl stop`, `erl scale` and `erl resume`: ask erld to change a submitted job."""

from __future__ import annotations

import argparse

from elastic_rl import jobs
from elastic_rl.cli.common import add_command, endpoint
from elastic_rl.store.client import Store


async def cmd_stop(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        phase = await jobs.stop(store, args.job)
    print(f"job {args.job}: {phase}")
    return 0


def _engine_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an engine count: give a whole number, at least 1")
    return int(text)


async def cmd_scale(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        old = await jobs.scale(store, args.job, args.engines)
    print(f"job {args.job}: engines {old} -> {args.engines}; follow it with `erl status {args.job}`")
    return 0


async def cmd_resume(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        await jobs.resume(store, args.job, args.snapshot)
    where = "the newest valid snapshot" if args.snapshot is None else f"snapshot {args.snapshot}"
    print(f"job {args.job} resumes from {where}; follow it with `erl status {args.job}`")
    return 0


def add_control_commands(commands) -> None:
    """`erl stop`, `erl scale`, `erl resume`."""
    stop = add_command(commands, "stop", "stop a job's processes", "erl stop tiny-grpo", cmd_stop)
    stop.add_argument("job")

    scale = add_command(
        commands,
        "scale",
        "change the number of engines of a running job",
        "erl scale tiny-grpo --engines 3",
        cmd_scale,
    )
    scale.add_argument("job")
    scale.add_argument(
        "--engines", type=_engine_count, required=True, metavar="N", help="the new engine count (at least 1)"
    )

    resume = add_command(
        commands,
        "resume",
        "restart a stopped or failed job from its newest valid snapshot",
        "erl resume tiny-grpo --snapshot 40",
        cmd_resume,
    )
    resume.add_argument("job")
    resume.add_argument(
        "--snapshot",
        type=int,
        metavar="STEP",
        help="resume from this snapshot instead; what came after it is moved to <workdir>/rewound/",
    )
