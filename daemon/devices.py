"""Device slots in etcd: which are free on each node, and marking one failed.

Shared by the leader, which places pending jobs, and by a job runner, which
claims more slots for a moved replica or added engines. A slot is taken when
a running or stopping job lists it, and out of use when it is marked failed
(a quarantined device).
"""

from __future__ import annotations

from typing import Any

from elastic_rl.store import keys
from elastic_rl.store.client import Store

ACTIVE_PHASES = ("running", "stopping")


async def job_statuses(store: Store) -> dict[str, dict[str, Any]]:
    found = await store.get_prefix(keys.JOBS)
    return {keys.job_id_of(key): value for key, value in found.items() if key.endswith("/status")}


async def free_device_slots(store: Store, statuses: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    """Free slots per live node, given every job's status."""
    used: dict[str, set[int]] = {}
    for status in statuses.values():
        if status.get("phase") in ACTIVE_PHASES:
            used.setdefault(status["node"], set()).update(status.get("devices", []))
    failed: dict[str, set[int]] = {}
    for key, device in (await store.get_prefix(keys.DEVICES)).items():
        node, index = key.rsplit("/", 2)[-2:]
        if device.get("state") == "failed":
            failed.setdefault(node, set()).add(int(index))
    free = {}
    for key, info in (await store.get_prefix(keys.NODES)).items():
        node = key[len(keys.NODES) :]
        taken = used.get(node, set()) | failed.get(node, set())
        free[node] = [index for index in range(info["devices"]) if index not in taken]
    return free


async def mark_failed(store: Store, node: str, devices: list[int], lease) -> None:
    for device in devices:
        await store.put(keys.device(node, device), {"kind": "cpu", "state": "failed"}, lease=lease)
