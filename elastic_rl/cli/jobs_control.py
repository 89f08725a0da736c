"""`erl stop`, `erl scale` and `erl resume`: ask erld to change a submitted job."""

from __future__ import annotations

import argparse

from elastic_rl import jobs
from elastic_rl.cli.common import add_command, endpoint
from elastic_rl.errors import InputError
from elastic_rl.store.client import Store


async def cmd_stop(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        phase = await jobs.stop(store, args.job)
    print(f"job {args.job}: {phase}")
    return 0


def _size(text: str) -> int | tuple[int, int]:
    """N (pin N within the range) or MIN:MAX (a new range)."""
    parts = text.split(":")
    if len(parts) > 2 or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX: give whole numbers, at least 1")
    return int(parts[0]) if len(parts) == 1 else (int(parts[0]), int(parts[1]))


async def cmd_scale(args: argparse.Namespace) -> int:
    asked = {name: value for name, value in (("replicas", args.replicas), ("engines", args.engines)) if value}
    if not asked:
        raise InputError("erl scale: give --replicas or --engines (N, or MIN:MAX)")
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        changed = await jobs.scale(store, args.job, asked)
    for name, (before, after) in changed.items():
        print(f"job {args.job}: {name} {before} -> {after}")
    print(f"follow it with `erl status {args.job}`")
    return 0


async def cmd_resume(args: argparse.Namespace) -> int:
    jobs.check_reshardable(args.overrides)
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        await jobs.resume(store, args.job, args.snapshot, args.overrides)
    where = "the newest valid snapshot" if args.snapshot is None else f"snapshot {args.snapshot}"
    relaid = f", laid out anew ({', '.join(args.overrides)})" if args.overrides else ""
    print(f"job {args.job} resumes from {where}{relaid}; follow it with `erl status {args.job}`")
    return 0


def add_control_commands(commands) -> None:
    """`erl stop`, `erl scale`, `erl resume`."""
    stop = add_command(commands, "stop", "stop a job's processes", "erl stop tiny-grpo", cmd_stop)
    stop.add_argument("job")

    scale = add_command(
        commands,
        "scale",
        "change a running job's trainer replicas or engines: a count within its range, or a new range",
        "erl scale tiny-grpo --engines 2:4",
        cmd_scale,
    )
    scale.add_argument("job")
    for name in ("replicas", "engines"):
        scale.add_argument(
            f"--{name}",
            type=_size,
            metavar="N|MIN:MAX",
            help=f"N: exactly N {name}, within the job's range; MIN:MAX: a new range (grown into where slots are free)",
        )

    resume = add_command(
        commands,
        "resume",
        "restart a stopped or failed job from its newest valid snapshot, in the same or another replica layout",
        "erl resume tiny-grpo --snapshot 40 --set trainer.tensor_parallel=1 --set trainer.data_parallel=2",
        cmd_resume,
    )
    resume.add_argument("job")
    resume.add_argument(
        "--snapshot",
        type=int,
        metavar="STEP",
        help="resume from this snapshot instead; what came after it is moved to <workdir>/rewound/",
    )
    resume.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"change the replica layout: {', '.join(jobs.RESHARDABLE)} (the snapshot reshards); repeatable",
    )
