"""`erl nodes`, `erl drain`, `erl undrain` and `erl devices reset`: what the cluster's nodes offer and run,
emptying a node on notice, and clearing a device's failed mark."""

from __future__ import annotations

import argparse
import time

import orjson

from elastic_rl import jobs
from elastic_rl.cli.common import add_command, add_command_group, endpoint
from elastic_rl.errors import InputError
from elastic_rl.store.client import Store
from elastic_rl.store.devices import reset_device
from policies.memory import GIB


async def cmd_nodes(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        cluster = await jobs.describe_nodes(store)
    if args.output == "json":
        print(orjson.dumps(cluster, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"leader: {cluster['leader'] or '-'}")
    for node in cluster["nodes"]:
        drain = node["drain"]
        if drain is None:
            draining = ""
        elif drain["drained"]:
            draining = ", drained"
        else:
            draining = f", draining ({max(0.0, drain['deadline'] - time.time()):.0f} s to its deadline)"
        memory = "" if node["slot_memory"] is None else f" of {node['slot_memory'] / GIB:.1f} GiB"
        print(
            f"node {node['node']} ({node['advertise_host']}, erld pid {node['pid']}): "
            f"{len(node['devices'])} device slots{memory}{draining}"
        )
        for device in node["devices"]:
            detail = device.get("proc") or ""
            if device["state"] == "failed":
                detail = device["reason"] + ("" if device["until"] is None else " (until a cool-down ends)")
            print(f"  device {device['device']:<3} {device['state']:<7} {detail}")
        if node["procs_without_device"]:
            print(f"  no device:  {', '.join(node['procs_without_device'])}")
    return 0


async def cmd_drain(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        drain = await jobs.drain(store, args.node, args.deadline)
    left = max(0.0, drain["deadline"] - time.time())
    print(
        f"node {args.node} drains within {left:.0f} s: it takes no new process, and what runs there leaves at safe "
        f"points; follow it with `erl nodes`"
    )
    return 0


async def cmd_undrain(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        await jobs.require_daemon(store)
        await jobs.undrain(store, args.node)
    print(f"node {args.node} takes new processes again")
    return 0


async def cmd_devices_reset(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
        cleared = await reset_device(store, args.node, args.device)
    if not cleared:
        raise InputError(
            f"device {args.device} of node {args.node} is not marked failed; `erl nodes` shows the devices"
        )
    print(f"device {args.device} of node {args.node} is usable again")
    return 0


def add_cluster_commands(commands) -> None:
    """`erl nodes`, `erl drain`, `erl undrain`, `erl devices` and its subcommand `reset`."""
    nodes = add_command(
        commands,
        "nodes",
        "list the nodes, their device slots and what runs where, and the leader",
        "erl nodes -o json",
        cmd_nodes,
    )
    nodes.add_argument("-o", "--output", choices=("text", "json"), default="text")

    drain = add_command(
        commands,
        "drain",
        "empty a node by a deadline: engines hand over their requests, replicas leave the quorum after a rollout, "
        "the services move after a commit; what is left at the deadline is recovered as after a node death",
        "erl drain node-b --deadline 120",
        cmd_drain,
    )
    drain.add_argument("node")
    drain.add_argument(
        "--deadline", type=float, default=120.0, metavar="S", help="seconds until the node goes (default: 120)"
    )
    undrain = add_command(
        commands, "undrain", "let a drained node take new processes again", "erl undrain node-b", cmd_undrain
    )
    undrain.add_argument("node")

    device_commands = add_command_group(
        commands, "devices", "device slots: clear a failed mark", "erl devices reset node-b 3"
    )
    reset = add_command(
        device_commands,
        "reset",
        "make a device marked failed usable again",
        "erl devices reset node-b 3",
        cmd_devices_reset,
    )
    reset.add_argument("node")
    reset.add_argument("device", type=int)
