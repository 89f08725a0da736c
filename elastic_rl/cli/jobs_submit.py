"""`erl validate`, `erl plan`, `erl run` and `erl submit`: check a job spec and the memory its trainer ranks
need, hand the job to erld, and (`run`) follow it to its end, starting a background erld first if none is
running."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from elastic_rl import jobs
from elastic_rl.cli.common import EXIT_FAILED, EXIT_INTERRUPTED, add_command, endpoint, endpoint_given
from elastic_rl.cli.erld import daemon_running, start_background_daemon
from elastic_rl.memory_plan import MemoryPlan, plan, precision_of
from elastic_rl.spec.job import JobSpec
from elastic_rl.spec.loading import dump_spec, load_spec
from elastic_rl.store.client import Store, StoreUnavailable
from elastic_rl.store.job_phase import JobPhase
from policies.memory import GIB, MEGATRON_BF16, MIB

SECOND_INTERRUPT_S = 5.0
FOLLOW_INTERVAL_S = 0.5


def _checked_spec(args: argparse.Namespace) -> JobSpec:
    """The spec, validated, with its data files (and a debug.train_only rollout log) read the way the
    run will read them, and a distillation teacher checked against the policy."""
    spec = load_spec(args.spec, args.overrides)
    if spec.data.path is not None or spec.eval.datasets or spec.debug.train_only is not None:
        from elastic_rl.rollout.prompts import check_data  # reads the tokenizer: transformers

        report = check_data(spec)
        if report is not None:
            print(report.summary(), file=sys.stderr)
    if spec.algorithm.distillation is not None:
        from elastic_rl.model.teacher import check_teacher  # reads both tokenizers: transformers

        check_teacher(spec)
    return spec


def _spec_and_workdir(args: argparse.Namespace) -> tuple[JobSpec, Path]:
    spec = _checked_spec(args)
    workdir = args.workdir or spec.resolved_workdir
    return spec.model_copy(update={"workdir": workdir}), workdir


def cmd_validate(args: argparse.Namespace) -> int:
    spec = _checked_spec(args)
    sys.stdout.write(dump_spec(spec))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    sys.stdout.write(memory_table(spec, plan(spec)))
    return 0


def memory_table(spec: JobSpec, planned: MemoryPlan) -> str:
    memory = planned.memory

    def size(count: int) -> str:
        return f"{count / GIB:10.2f} GiB" if count >= GIB else f"{count / MIB:10.2f} MiB"

    bound = (
        "rollout.max_prompt_len + rollout.max_new_tokens"
        if spec.rollout.max_prompt_len is not None
        else "the model's context; set rollout.max_prompt_len to bound it"
    )
    precision = precision_of(spec)
    trainer = spec.trainer
    moments = "AdamW's two moments"
    optimizer_state = f"fp32 main weights and {moments}" if precision is MEGATRON_BF16 else moments
    critic = f"  critic          {size(memory.critic_bytes)}  (PPO's value model: weights, gradients, optimizer)"
    lines = [
        f"one trainer rank of {spec.name}: {planned.layout}, {precision.name}",
        f"  parameters      {memory.parameters:>14,}  (this rank's share of the model)",
        f"  weights         {size(memory.parameter_bytes)}",
        f"  gradients       {size(memory.gradient_bytes)}",
        f"  optimizer       {size(memory.optimizer_bytes)}  ({optimizer_state}: this rank's share"
        f"{'; in host memory, below' if trainer.optimizer_offload else ''})",
        f"  frozen models   {size(memory.frozen_bytes)}  (the KL reference with algorithm.kl_coef > 0, "
        f"a distillation teacher)",
        *([critic] if memory.critic_bytes else []),
        f"  activations     {size(memory.activation_bytes)}  (estimate: a micro-batch of {planned.tokens:,} "
        f"{'tokens packed' if trainer.packing else 'token slots'}, samples up to {planned.sequence:,} tokens: "
        f"{bound}; attention {trainer.attention.value}, recompute {trainer.recompute.value}"
        f"{', sequence parallel' if trainer.sequence_parallel else ''})",
        f"  total           {size(memory.total)}",
    ]
    if trainer.optimizer_offload:
        whose = " of the policy and the critic" if memory.critic_bytes else ""
        lines.append(
            f"  host memory     {size(memory.host_bytes)}  ({moments}{whose}, this rank's share, and two buffers "
            "of its largest tensor for the step's copies: trainer.optimizer_offload)"
        )
    return "\n".join(lines) + "\n"


async def cmd_submit(args: argparse.Namespace) -> int:
    spec, workdir = _spec_and_workdir(args)
    async with Store(endpoint(args), attempts=1) as store:
        job_id = await jobs.submit(store, spec, workdir)
    print(f"submitted job {job_id} (work dir {workdir})")
    print(f"  follow it:   erl status {job_id}")
    print(f"  its logs:    erl logs {job_id} -f")
    print(f"  stop it:     erl stop {job_id}")
    return 0


async def cmd_run(args: argparse.Namespace) -> int:
    spec, workdir = _spec_and_workdir(args)
    etcd_endpoint = endpoint(args)
    if not await daemon_running(etcd_endpoint):
        if endpoint_given(args):
            raise jobs.NoDaemon(jobs.no_daemon_message(etcd_endpoint))
        # A job that runs only on GPUs gets this machine's GPUs; any other, CPU slots.
        slots = ["--gpus", "all"] if spec.needs_cuda else ["--cpu-devices", str(max(4, spec.devices_needed))]
        pid = await start_background_daemon(etcd_endpoint, slots)
        print(
            f"started erld (pid {pid}, etcd {etcd_endpoint}); it keeps running for `erl status`; "
            "stop it with `erl shutdown`"
        )
    async with Store(etcd_endpoint) as store:
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
    unreachable = False
    while True:
        try:
            info = await jobs.describe(store, job_id, events=0)
        except StoreUnavailable as exc:
            # A control-plane blip is not the job's end: its processes run on (fenced) meanwhile.
            if not unreachable:
                print(f"\netcd is unreachable ({exc}); waiting for it (Ctrl-C to stop following)", flush=True)
            unreachable = True
            await asyncio.sleep(FOLLOW_INTERVAL_S)
            continue
        if unreachable:
            print("etcd answers again", flush=True)
            unreachable = False
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
            return 0 if phase == JobPhase.SUCCEEDED else EXIT_FAILED
        await asyncio.sleep(FOLLOW_INTERVAL_S)


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


def add_submit_commands(commands) -> None:
    """`erl validate`, `erl run`, `erl submit`."""
    validate = add_command(
        commands,
        "validate",
        "check a job spec and print it with every default filled in",
        "erl validate examples/tiny-grpo.yaml --set trainer.lr=3e-4 --set engines.count=4",
        cmd_validate,
        etcd=False,
    )
    _add_spec_arguments(validate)

    plan_command = add_command(
        commands,
        "plan",
        "print the memory one trainer rank needs: weights, gradients, optimizer, activations",
        "erl plan examples/smollm2-math.yaml --set rollout.max_prompt_len=256",
        cmd_plan,
        etcd=False,
    )
    _add_spec_arguments(plan_command)

    run = add_command(
        commands,
        "run",
        "run a job end to end: start erld if none is running, submit, follow to the end",
        "erl run examples/tiny-grpo.yaml --workdir runs/try-1",
        cmd_run,
    )
    _add_spec_arguments(run)
    _add_workdir(run)

    submit = add_command(
        commands,
        "submit",
        "submit a job to the running erld and print its id",
        "erl submit examples/tiny-grpo.yaml --set rollout.num_rollouts=50",
        cmd_submit,
    )
    _add_spec_arguments(submit)
    _add_workdir(submit)
