"""`erl`, the command line users drive elastic-rl with.

Every subcommand's help ends with an example. The CLI imports no torch, so it
answers in well under a second. Exit codes: 0 success, 1 a failure at run time,
2 bad input (an invalid spec, a missing file), with every problem printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elastic_rl.config import dump_spec, load_spec
from elastic_rl.errors import SpecError

EXIT_BAD_INPUT = 2


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


def cmd_validate(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    sys.stdout.write(dump_spec(spec))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="erl",
        description="elastic-rl: RL post-training that keeps going when hardware fails.",
        epilog="example:\n  erl validate examples/tiny-grpo.yaml --set rollout.temperature=0.7",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    validate = commands.add_parser(
        "validate",
        help="check a job spec and print it resolved",
        description="Validate a job spec and print it with every default filled in. "
        "On error, print each problem with its field path and exit 2.",
        epilog="example:\n  erl validate examples/tiny-grpo.yaml --set trainer.lr=3e-4 --set engines.count=4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_spec_arguments(validate)
    validate.set_defaults(handler=cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except SpecError as exc:
        count = len(exc.problems)
        print(f"error: the job spec has {count} problem{'s' if count != 1 else ''}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
