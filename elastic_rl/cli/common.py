"""What every `erl` command shares: the exit codes, the etcd client options, and the helpers that make
a subcommand (with the example its help ends with) or a group of subcommands."""

from __future__ import annotations

import argparse
import os

from elastic_rl.store import credentials
from elastic_rl.store.client import DEFAULT_ENDPOINT
from elastic_rl.store.credentials import EtcdCredentials

EXIT_FAILED = 1
"""The command failed: the job failed (`erl run`), etcd or erld could not be reached, or the operation
was refused."""
EXIT_BAD_INPUT = 2
"""Bad input: a spec, file or argument was refused, naming the field or file and what to do. Nothing was
submitted or changed."""
EXIT_INTERRUPTED = 130
"""Interrupted by Ctrl-C (`erl run` leaves the job running under erld unless a second Ctrl-C stops it)."""
ETCD_ENV = "ERL_ETCD"


def add_etcd_options(parser: argparse.ArgumentParser) -> None:
    """The options of a command that talks to etcd as a client."""
    parser.add_argument("--etcd", metavar="URL", help=f"etcd endpoint (default: ${ETCD_ENV} or {DEFAULT_ENDPOINT})")
    add_etcd_credential_options(parser)


def add_etcd_credential_options(parser: argparse.ArgumentParser) -> None:
    """How to reach a secured etcd; each option's default is its environment variable."""
    group = parser.add_argument_group("a secured etcd (https:// endpoints, etcd's auth)")
    for option, variable, what in (
        ("--etcd-cacert", credentials.CACERT_ENV, "the CA that signed etcd's certificate (required for https://)"),
        ("--etcd-cert", credentials.CERT_ENV, "this client's certificate, where etcd asks for one"),
        ("--etcd-key", credentials.KEY_ENV, "the key of --etcd-cert"),
        ("--etcd-user", credentials.USER_ENV, "the etcd user to sign in as (with etcd's auth enabled)"),
        ("--etcd-password-file", credentials.PASSWORD_FILE_ENV, "a file holding --etcd-user's password"),
    ):
        metavar = "NAME" if option == "--etcd-user" else "FILE"
        group.add_argument(option, metavar=metavar, help=f"{what} (default: ${variable})")


def use_etcd_credentials(args: argparse.Namespace) -> None:
    """Make the etcd options given this command the environment's, where every etcd client of this
    process (``Store``'s default) and every process erld starts finds them."""
    if not hasattr(args, "etcd_cacert"):
        return
    given = EtcdCredentials.from_environ().overridden(
        cacert=args.etcd_cacert,
        cert=args.etcd_cert,
        key=args.etcd_key,
        user=args.etcd_user,
        password_file=args.etcd_password_file,
    )
    os.environ.update(given.environ())


def endpoint(args: argparse.Namespace) -> str:
    """The etcd endpoint: ``--etcd``, else ``$ERL_ETCD``, else the embedded etcd's address."""
    return args.etcd or os.environ.get(ETCD_ENV) or DEFAULT_ENDPOINT


def endpoint_given(args: argparse.Namespace) -> bool:
    """Whether ``--etcd`` or ``$ERL_ETCD`` names the endpoint, rather than the embedded etcd's default."""
    return bool(args.etcd or os.environ.get(ETCD_ENV))


def add_command(
    commands, name: str, help_text: str, example: str, handler, etcd: bool = True
) -> argparse.ArgumentParser:
    """A subcommand with its example; ``etcd``: it takes the etcd client options."""
    parser = commands.add_parser(
        name,
        help=help_text,
        description=help_text[0].upper() + help_text[1:] + ".",
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(handler=handler)
    if etcd:
        add_etcd_options(parser)
    return parser


def add_command_group(commands, name: str, help_text: str, example: str):
    """A command whose subcommands (added to what this returns) do the work, e.g. `erl chaos run`."""
    group = commands.add_parser(
        name,
        help=help_text,
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return group.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")
