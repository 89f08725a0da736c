"""`erl status`, `erl list` and `erl logs`: read what erld and the job's work dir say about jobs, and
print it for people (or as JSON)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from checkpoints import layout
from elastic_rl import jobs
from elastic_rl.cli.common import add_command, endpoint
from elastic_rl.errors import ElasticRLError
from elastic_rl.store.client import Store, StoreUnavailable
from policies.capacity import Size


async def cmd_status(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        job_ids = [args.job] if args.job else await jobs.job_ids(store)
        described = [await jobs.describe(store, job_id) for job_id in job_ids]
    if args.output == "json":
        print(orjson.dumps(described if not args.job else described[0], option=orjson.OPT_INDENT_2).decode())
        return 0
    if not described:
        print("no jobs; submit one with `erl submit SPEC`")
    for info in described:
        print(_format_status(info))
    return 0


def _format_status(info: dict[str, Any]) -> str:
    status, progress = info["status"], info["progress"]
    lines = [f"job {info['job']}: {status['phase']}" + (f" ({status['reason']})" if status.get("reason") else "")]
    if status.get("unplaced"):
        lines.append(f"  waiting for room: {', '.join(status['unplaced'])} (the job runs on without them)")
    for reason in status.get("degraded", []):
        lines.append(f"  degraded: {reason}")
    nodes = sorted({proc["node"] for proc in info["procs"].values() if proc.get("node")})
    lines.append(f"  work dir: {status.get('workdir')}   nodes: {', '.join(nodes) or '-'}")
    if status.get("size"):
        lines.append("  " + ", ".join(_size(kind, *held_min_max) for kind, held_min_max in status["size"].items()))
    reward = progress.get("reward_mean")
    lines.append(
        f"  rollouts: {progress.get('rollouts_done', 0)}/{info['num_rollouts']}   "
        f"weight version: {progress.get('weight_version', 0)}   "
        f"reward: {'-' if reward is None else f'{reward:.3f}'}"
    )
    snapshot, log = info.get("snapshot"), info.get("rollout_log")
    lines.append(
        "  snapshot: "
        + ("none yet" if snapshot is None else f"step {snapshot['step']} (after rollout {snapshot['last_rollout']})")
        + "   rollout log: "
        + ("empty" if log is None else f"rollouts {log[0]}..{log[1]}")
    )
    if info.get("stragglers"):
        found = info["stragglers"]
        replaced = sum(bool(event.get("replaced")) for event in found)
        last = found[-1]
        lines.append(
            f"  stragglers: {replaced} replaced, {len(found) - replaced} kept for want of room; "
            f"last: {last.get('proc')} at step {last.get('step')}, {last['message']}"
        )
    if info["procs"]:
        lines.append("  processes:")
        for name, proc in info["procs"].items():
            lines.append(
                f"    {name:<14} {proc['state']:<10} node {proc.get('node', '-'):<10} pid {proc.get('pid') or '-':<8} "
                f"device {'-' if proc.get('device') is None else proc['device']:<3} restarts {proc['restarts']}"
            )
    if info["events"]:
        lines.append("  recent events:")
        for event in info["events"]:
            when = datetime.fromtimestamp(event["time"]).strftime("%H:%M:%S")
            proc = f" [{event['proc']}]" if event.get("proc") else ""
            where = "".join(f" {key}={event[key]}" for key in ("device", "step") if event.get(key) is not None)
            lines.append(f"    {when} {event['kind']}{proc}{where} {event['message']}")
    return "\n".join(lines)


async def cmd_list(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        described = [await jobs.describe(store, job_id, events=0) for job_id in await jobs.job_ids(store)]
        if args.all:
            described = await jobs.history(store) + described
    rows = [
        {
            "job": info["job"],
            "phase": info["status"]["phase"],
            "rollouts_done": info["progress"].get("rollouts_done", 0),
            "num_rollouts": info["num_rollouts"],
            "reward_mean": info["progress"].get("reward_mean"),
            "workdir": info["status"].get("workdir"),
        }
        for info in described
    ]
    if args.output == "json":
        print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"{'JOB':<24} {'PHASE':<10} {'ROLLOUTS':<10} {'REWARD':<7} WORK DIR")
    for row in rows:
        reward = "-" if row["reward_mean"] is None else f"{row['reward_mean']:.3f}"
        rollouts = f"{row['rollouts_done']}/{row['num_rollouts']}"
        print(f"{row['job']:<24} {row['phase']:<10} {rollouts:<10} {reward:<7} {row['workdir']}")
    return 0


async def cmd_logs(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        info = await jobs.describe(store, args.job, events=0)
    log_dir = layout.logs_dir(Path(info["status"]["workdir"]))
    if args.proc:
        files = [log_dir / f"{args.proc}.log"]
        if not files[0].is_file():
            known = sorted(p.stem for p in log_dir.glob("*.log"))
            raise ElasticRLError(f"no log for process {args.proc!r}; known: {', '.join(known) or 'none yet'}")
    else:
        files = sorted(log_dir.glob("*.log"))
    if not args.follow:
        for file in files:
            for line in file.read_text(errors="replace").splitlines():
                print(f"{file.stem}: {line}" if len(files) > 1 else line)
        return 0
    async with Store(endpoint(args), attempts=1) as store:
        await _follow(files, store, args.job)
    return 0


async def _follow(files: list[Path], store: Store, job_id: str) -> None:
    """Print new lines as they come, until the job is over (then what is left, and stop)."""
    handles = {file: open(file, errors="replace") for file in files}
    unreachable = False
    while True:
        try:
            over = (await jobs.describe(store, job_id, events=0))["status"]["phase"] in jobs.TERMINAL_PHASES
        except StoreUnavailable as exc:
            # The logs go on meanwhile: a control-plane blip does not end the job.
            if not unreachable:
                print(f"etcd is unreachable ({exc}); following the logs until it answers", file=sys.stderr)
            unreachable, over = True, False
        else:
            unreachable = False
        quiet = True
        for file, handle in handles.items():
            line = handle.readline()
            while line:
                quiet = False
                print(f"{file.stem}: {line}" if len(files) > 1 else line, end="", flush=True)
                line = handle.readline()
        if over:
            return
        if quiet:
            await asyncio.sleep(0.2)


def add_read_commands(commands) -> None:
    """`erl status`, `erl list`, `erl logs`."""
    status = add_command(
        commands,
        "status",
        "show a job's phase, progress, processes and recent events (all jobs without JOB)",
        "erl status tiny-grpo -o json",
        cmd_status,
    )
    status.add_argument("job", nargs="?", help="job id (default: every job)")
    status.add_argument("-o", "--output", choices=("text", "json"), default="text")

    listing = add_command(commands, "list", "list the jobs", "erl list --all -o json", cmd_list)
    listing.add_argument("-o", "--output", choices=("text", "json"), default="text")
    listing.add_argument("--all", action="store_true", help="also earlier jobs whose names were used again")

    logs = add_command(
        commands, "logs", "print a job's process logs", "erl logs tiny-grpo -f --proc trainer-0-0", cmd_logs
    )
    logs.add_argument("job")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("--proc", help="one process, e.g. orchestrator, engine-0, trainer-0-0")


def _size(kind: str, held: int, least: int, most: int) -> str:
    """What the job holds of a kind and the range it may hold: "replicas 2 (1..3)"."""
    return f"{kind} {held} ({Size(least, most)})"
