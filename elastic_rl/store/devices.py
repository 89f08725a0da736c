"""Device slots in etcd: which are free on each live node, and the ledger of failed ones.

A node's slots are 0..devices-1 of its node record. A slot is taken while an
assignment of an active job names it, and out of use while the ledger marks
it failed: a quarantined device (the NaN guard) or a killed one (the chaos
harness). The ledger has no lease, so a failed device stays failed across
erld restarts, until `erl devices reset NODE DEV` or the end of its cool-down.
Shared by the controller (placement), the agents (marking failures) and
`erl scale` and `erl nodes` (reading).
"""

from __future__ import annotations

import time
from typing import Any

from elastic_rl.store import keys
from elastic_rl.store.client import Store
from elastic_rl.store.job_phase import ACTIVE_PHASES


async def job_statuses(store: Store) -> dict[str, dict[str, Any]]:
    found = await store.get_prefix(keys.JOBS)
    return {keys.job_id_of(key): value for key, value in found.items() if key.endswith("/status")}


async def all_assignments(store: Store) -> dict[str, dict[str, dict[str, Any]]]:
    """Job -> process -> its assignment."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for key, value in (await store.get_prefix(keys.ASSIGN)).items():
        found.setdefault(keys.job_id_of(key), {})[keys.last_part(key)] = value
    return found


async def live_nodes(store: Store) -> dict[str, dict[str, Any]]:
    return {key[len(keys.NODES) :]: value for key, value in (await store.get_prefix(keys.NODES)).items()}


def failed_slots(ledger: dict[str, dict[str, Any]], now: float) -> dict[str, set[int]]:
    """Node -> slots the ledger marks failed at ``now`` (a cool-down that has run out no longer counts)."""
    failed: dict[str, set[int]] = {}
    for key, entry in ledger.items():
        node, index = key.rsplit("/", 2)[-2:]
        if entry.get("until") is None or entry["until"] > now:
            failed.setdefault(node, set()).add(int(index))
    return failed


async def ledger(store: Store) -> dict[str, dict[str, Any]]:
    return await store.get_prefix(keys.LEDGER)


def assignment_slots(assignment: dict[str, Any]) -> tuple[int, ...]:
    """The slots an assignment holds: its ``devices`` when it holds several (an SGLang engine with
    tensor parallelism), else its one ``device``, else none."""
    if assignment.get("devices"):
        return tuple(assignment["devices"])
    return () if assignment.get("device") is None else (assignment["device"],)


def used_slots(
    statuses: dict[str, dict[str, Any]], assignments: dict[str, dict[str, dict[str, Any]]]
) -> dict[str, set[int]]:
    """Node -> slots that assignments of active jobs hold."""
    used: dict[str, set[int]] = {}
    for job_id, procs in assignments.items():
        if statuses.get(job_id, {}).get("phase") not in ACTIVE_PHASES:
            continue
        for assignment in procs.values():
            for slot in assignment_slots(assignment):
                used.setdefault(assignment["node"], set()).add(slot)
    return used


async def free_device_slots(store: Store, statuses: dict[str, dict[str, Any]] | None = None) -> dict[str, list[int]]:
    """Free slots per live node that is not draining."""
    statuses = statuses if statuses is not None else await job_statuses(store)
    used = used_slots(statuses, await all_assignments(store))
    failed = failed_slots(await ledger(store), time.time())
    draining = await store.get_prefix(keys.DRAINS)
    free = {}
    for node, info in (await live_nodes(store)).items():
        if keys.drain(node) not in draining:
            taken = used.get(node, set()) | failed.get(node, set())
            free[node] = [index for index in range(info["devices"]) if index not in taken]
    return free


async def mark_failed(
    store: Store, node: str, devices: list[int], reason: str, cooldown_s: float | None = None
) -> None:
    now = time.time()
    for device in devices:
        await store.put(
            keys.ledger_entry(node, device),
            {
                "state": "failed",
                "reason": reason,
                "since": now,
                "until": None if cooldown_s is None else now + cooldown_s,
            },
        )


async def reset_device(store: Store, node: str, device: int) -> bool:
    """Clear a device's failed mark; False if it had none."""
    key = keys.ledger_entry(node, device)
    if await store.get(key) is None:
        return False
    await store.delete(key)
    return True
