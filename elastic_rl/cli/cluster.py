"""`erl nodes` and `erl devices reset`: what the cluster's nodes offer and run, and clearing a device's
failed mark."""

from __future__ import annotations

import argparse

import orjson

from elastic_rl import jobs
from elastic_rl.cli.common import add_command, add_command_group, endpoint
from elastic_rl.errors import InputError
from elastic_rl.store.client import Store
from elastic_rl.store.devices import reset_device


async def cmd_nodes(args: argparse.Namespace) -> int:
    async with Store(endpoint(args), attempts=1) as store:
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
    async with Store(endpoint(args), attempts=1) as store:
        cleared = await reset_device(store, args.node, args.device)
    if not cleared:
        raise InputError(
            f"device {args.device} of node {args.node} is not marked failed; `erl nodes` shows the devices"
        )
    print(f"device {args.device} of node {args.node} is usable again")
    return 0


def add_cluster_commands(commands) -> None:
    """`erl nodes`, `erl devices` and its subcommand `reset`."""
    nodes = add_command(
        commands,
        "nodes",
        "list the nodes, their device slots and what runs where, and the leader",
        "erl nodes -o json",
        cmd_nodes,
    )
    nodes.add_argument("-o", "--output", choices=("text", "json"), default="text")

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
