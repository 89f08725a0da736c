"""`erl`, the command line users drive elastic-rl with.

Every subcommand's help ends with an example. The CLI imports no torch, so it
answers in well under a second. Every command reaches etcd at ``--etcd URL``
(default: ``$ERL_ETCD``, else the embedded etcd's address). Exit codes: 0
success, 1 a job or command that failed, 2 bad input (an invalid spec, a
missing file), with every problem printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from elastic_rl import jobs
from elastic_rl.config import JobSpec, dump_spec, load_spec
from elastic_rl.errors import ElasticRLError, SpecError
from elastic_rl.store.client import DEFAULT_ENDPOINT, Store, StoreUnavailable

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
ETCD_ENV = "ERL_ETCD"
DAEMON_STATE_DIR = Path("runs/.erld")


def _endpoint(args: argparse.Namespace) -> str:
    return args.etcd or os.environ.get(ETCD_ENV) or DEFAULT_ENDPOINT


def _spec_and_workdir(args: argparse.Namespace) -> tuple[JobSpec, Path]:
    spec = load_spec(args.spec, args.overrides)
    workdir = args.workdir or spec.resolved_workdir
    return spec.model_copy(update={"workdir": workdir}), workdir


# --- commands -------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    sys.stdout.write(dump_spec(spec))
    return 0


async def cmd_submit(args: argparse.Namespace) -> int:
    spec, workdir = _spec_and_workdir(args)
    async with Store(_endpoint(args), attempts=1) as store:
        job_id = await jobs.submit(store, spec, workdir)
    print(f"submitted job {job_id} (work dir {workdir})")
    print(f"  follow it:   erl status {job_id}")
    print(f"  its logs:    erl logs {job_id} -f")
    print(f"  stop it:     erl stop {job_id}")
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    async with Store(_endpoint(args), attempts=1) as store:
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
    lines.append(f"  work dir: {status.get('workdir')}   node: {status.get('node', '-')}")
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
    if info["procs"]:
        lines.append("  processes:")
        for name, proc in info["procs"].items():
            lines.append(
                f"    {name:<14} {proc['state']:<10} pid {proc.get('pid') or '-':<8} "
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
    async with Store(_endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        described = [await jobs.describe(store, job_id, events=0) for job_id in await jobs.job_ids(store)]
    rows = [
        {
            "job": info["job"],
            "phase": info["status"]["phase"],
            "rollouts_done": info["progress"].get("rollouts_done", 0),
            "num_rollouts": info["num_rollouts"],
            "reward_mean": info["progress"].get("reward_mean"),
        }
        for info in described
    ]
    if args.output == "json":
        print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"{'JOB':<24} {'PHASE':<10} {'ROLLOUTS':<10} REWARD")
    for row in rows:
        reward = "-" if row["reward_mean"] is None else f"{row['reward_mean']:.3f}"
        print(f"{row['job']:<24} {row['phase']:<10} {row['rollouts_done']}/{row['num_rollouts']:<8} {reward}")
    return 0


async def cmd_stop(args: argparse.Namespace) -> int:
    async with Store(_endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        phase = await jobs.stop(store, args.job)
    print(f"job {args.job}: {phase}")
    return 0


def _engine_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an engine count: give a whole number, at least 1")
    return int(text)


async def cmd_scale(args: argparse.Namespace) -> int:
    async with Store(_endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        old = await jobs.scale(store, args.job, args.engines)
    print(f"job {args.job}: engines {old} -> {args.engines}; follow it with `erl status {args.job}`")
    return 0


async def cmd_resume(args: argparse.Namespace) -> int:
    async with Store(_endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        await jobs.resume(store, args.job, args.snapshot)
    where = "the newest valid snapshot" if args.snapshot is None else f"snapshot {args.snapshot}"
    print(f"job {args.job} resumes from {where}; follow it with `erl status {args.job}`")
    return 0


async def cmd_logs(args: argparse.Namespace) -> int:
    async with Store(_endpoint(args), attempts=1) as store:
        info = await jobs.describe(store, args.job, events=0)
    log_dir = Path(info["status"]["workdir"]) / "logs"
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
    await _follow(files)
    return 0


async def _follow(files: list[Path]) -> None:
    handles = {file: open(file, errors="replace") for file in files}
    while True:
        quiet = True
        for file, handle in handles.items():
            line = handle.readline()
            while line:
                quiet = False
                print(f"{file.stem}: {line}" if len(files) > 1 else line, end="", flush=True)
                line = handle.readline()
        if quiet:
            await asyncio.sleep(0.2)


def cmd_daemon(args: argparse.Namespace) -> int:
    import logging

    from daemon.erld import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args.etcd, args.cpu_devices, args.state_dir, args.node, args.etcd_port))
    return 0


async def _daemon_running(endpoint: str) -> bool:
    async with Store(endpoint, timeout_s=2.0, attempts=1) as store:
        try:
            await jobs.require_daemon(store)
        except jobs.NoDaemon:
            return False
    return True


async def _etcd_answers(endpoint: str) -> bool:
    async with Store(endpoint, timeout_s=2.0, attempts=1) as store:
        try:
            await store.get("/erl/ping")
        except StoreUnavailable:
            return False
    return True


async def _start_background_daemon(endpoint: str, cpu_devices: int) -> int:
    """Start `erl daemon` in its own session; it outlives `erl run`.

    It uses the etcd already at ``endpoint`` if one answers there (Debian's
    etcd-server runs one as a service), else starts an embedded one on that port.
    """
    DAEMON_STATE_DIR.mkdir(parents=True, exist_ok=True)
    if await _etcd_answers(endpoint):
        etcd_args = ["--etcd", endpoint]
    else:
        etcd_args = ["--etcd-port", endpoint.rsplit(":", 1)[1]]
    log = open(DAEMON_STATE_DIR / "erld.log", "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "elastic_rl.cli", "daemon", "--state-dir", str(DAEMON_STATE_DIR),
         "--cpu-devices", str(cpu_devices), *etcd_args],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    (DAEMON_STATE_DIR / "erld.pid").write_text(str(process.pid))
    deadline = time.monotonic() + 60
    while not await _daemon_running(endpoint):
        if process.poll() is not None or time.monotonic() > deadline:
            raise ElasticRLError(f"erld did not start; see {DAEMON_STATE_DIR / 'erld.log'}")
        await asyncio.sleep(0.3)
    return process.pid


async def cmd_run(args: argparse.Namespace) -> int:
    spec, workdir = _spec_and_workdir(args)
    endpoint = _endpoint(args)
    if not await _daemon_running(endpoint):
        if args.etcd or os.environ.get(ETCD_ENV):
            raise jobs.NoDaemon(jobs.no_daemon_message(endpoint))
        from daemon.job import devices_needed

        pid = await _start_background_daemon(endpoint, max(4, devices_needed(spec)))
        print(f"started erld (pid {pid}, etcd {endpoint}); it keeps running for `erl status`; "
              f"stop it with `kill {pid}`")
    async with Store(endpoint) as store:
        job_id = await jobs.submit(store, spec, workdir)
        print(f"running job {job_id} (work dir {workdir})")
        return await _follow_job(store, job_id)


async def _follow_job(store: Store, job_id: str) -> int:
    shown = -1
    interactive = sys.stdout.isatty()
    while True:
        info = await jobs.describe(store, job_id, events=0)
        phase, progress = info["status"]["phase"], info["progress"]
        done, total = progress.get("rollouts_done", 0), info["num_rollouts"] or 1
        if done != shown or interactive:
            reward = progress.get("reward_mean")
            bar = "#" * int(30 * done / total)
            line = (
                f"[{bar:<30}] rollout {done}/{total}  reward {'-' if reward is None else f'{reward:.3f}'}  ({phase})"
            )
            print(f"\r{line}" if interactive else line, end="" if interactive else "\n", flush=True)
            shown = done
        if phase in jobs.TERMINAL_PHASES:
            if interactive:
                print()
            reason = info["status"].get("reason")
            print(f"job {job_id} {phase}" + (f": {reason}" if reason else ""))
            return 0 if phase == "succeeded" else EXIT_FAILED
        await asyncio.sleep(0.5)


# --- the parser -------------------------------------------------------------------------


def _add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, help="job spec (YAML)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a spec field by its dotted path; repeatable",
    )  # fmt: skip


def _add_workdir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, help="the job's work dir (default: the spec's, else ./runs/<name>)")


def _command(commands, name: str, help_text: str, example: str, handler) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        name,
        help=help_text,
        description=help_text[0].upper() + help_text[1:] + ".",
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(handler=handler)
    if name not in ("validate", "daemon"):
        parser.add_argument("--etcd", metavar="URL", help=f"etcd endpoint (default: ${ETCD_ENV} or {DEFAULT_ENDPOINT})")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="erl",
        description="elastic-rl: RL post-training that keeps going when hardware fails.",
        epilog="examples:\n  erl run examples/tiny-grpo.yaml\n  erl status tiny-grpo\n"
        "  erl validate examples/tiny-grpo.yaml --set rollout.temperature=0.7",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    validate = _command(
        commands, "validate", "check a job spec and print it with every default filled in",
        "erl validate examples/tiny-grpo.yaml --set trainer.lr=3e-4 --set engines.count=4", cmd_validate,
    )  # fmt: skip
    _add_spec_arguments(validate)

    run = _command(
        commands, "run", "run a job end to end: start erld if none is running, submit, follow to the end",
        "erl run examples/tiny-grpo.yaml --workdir runs/try-1", cmd_run,
    )  # fmt: skip
    _add_spec_arguments(run)
    _add_workdir(run)

    submit = _command(
        commands, "submit", "submit a job to the running erld and print its id",
        "erl submit examples/tiny-grpo.yaml --set rollout.num_rollouts=50", cmd_submit,
    )  # fmt: skip
    _add_spec_arguments(submit)
    _add_workdir(submit)

    status = _command(
        commands, "status", "show a job's phase, progress, processes and recent events (all jobs without JOB)",
        "erl status tiny-grpo -o json", cmd_status,
    )  # fmt: skip
    status.add_argument("job", nargs="?", help="job id (default: every job)")
    status.add_argument("-o", "--output", choices=("text", "json"), default="text")

    listing = _command(commands, "list", "list the jobs", "erl list -o json", cmd_list)
    listing.add_argument("-o", "--output", choices=("text", "json"), default="text")

    logs = _command(
        commands, "logs", "print a job's process logs", "erl logs tiny-grpo -f --proc trainer-0-0", cmd_logs
    )
    logs.add_argument("job")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("--proc", help="one process, e.g. orchestrator, engine-0, trainer-0-0")

    stop = _command(commands, "stop", "stop a job's processes", "erl stop tiny-grpo", cmd_stop)
    stop.add_argument("job")

    scale = _command(
        commands, "scale", "change the number of engines of a running job",
        "erl scale tiny-grpo --engines 3", cmd_scale,
    )  # fmt: skip
    scale.add_argument("job")
    scale.add_argument("--engines", type=_engine_count, required=True, metavar="N", help="the new engine count (at least 1)")

    resume = _command(
        commands, "resume", "restart a stopped or failed job from its newest valid snapshot",
        "erl resume tiny-grpo --snapshot 40", cmd_resume,
    )  # fmt: skip
    resume.add_argument("job")
    resume.add_argument(
        "--snapshot", type=int, metavar="STEP",
        help="resume from this snapshot instead; what came after it is moved to <workdir>/rewound/",
    )  # fmt: skip

    daemon = _command(
        commands, "daemon", "run erld, the node daemon (systemd runs it as a service)",
        "erl daemon --cpu-devices 4 --state-dir /var/lib/erld", cmd_daemon,
    )  # fmt: skip
    daemon.add_argument("--etcd", metavar="URL", help="an existing etcd; without it erld starts an embedded one")
    daemon.add_argument("--etcd-port", type=int, default=2379, help="client port of the embedded etcd")
    daemon.add_argument("--cpu-devices", type=int, default=4, help="device slots this node offers (CPU nodes)")
    daemon.add_argument("--state-dir", type=Path, default=DAEMON_STATE_DIR, help="embedded etcd data and erld state")
    daemon.add_argument("--node", help="node name (default: the hostname)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.handler(args)
        return asyncio.run(result) if asyncio.iscoroutine(result) else result
    except SpecError as exc:
        count = len(exc.problems)
        print(f"error: the job spec has {count} problem{'s' if count != 1 else ''}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (jobs.NoDaemon, StoreUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ElasticRLError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
