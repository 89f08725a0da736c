"""The `erl` parser, assembled from the command groups in the order `erl --help` lists them, and `main`,
which runs the chosen command and turns its errors into messages and exit codes."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from elastic_rl import jobs
from elastic_rl.cli.chaos import add_chaos_commands
from elastic_rl.cli.cluster import add_cluster_commands
from elastic_rl.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, use_etcd_credentials
from elastic_rl.cli.erld import add_erld_commands
from elastic_rl.cli.jobs_control import add_control_commands
from elastic_rl.cli.jobs_read import add_read_commands
from elastic_rl.cli.jobs_submit import add_submit_commands
from elastic_rl.cli.model import add_model_commands
from elastic_rl.cli.plot import add_plot_command
from elastic_rl.errors import ElasticRLError, InputError, SpecError
from elastic_rl.store.client import StoreUnavailable


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="erl",
        description="elastic-rl: RL post-training that keeps going when hardware fails.",
        epilog="examples:\n  erl run examples/tiny-grpo.yaml\n  erl status tiny-grpo\n"
        "  erl validate examples/tiny-grpo.yaml --set rollout.temperature=0.7",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_submit_commands(commands)  # validate, run, submit
    add_read_commands(commands)  # status, list, logs
    add_plot_command(commands)  # plot
    add_control_commands(commands)  # stop, scale, resume
    add_chaos_commands(commands)  # chaos run
    add_model_commands(commands)  # model import
    add_cluster_commands(commands)  # nodes, devices reset
    add_erld_commands(commands)  # shutdown, daemon
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    use_etcd_credentials(args)
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
