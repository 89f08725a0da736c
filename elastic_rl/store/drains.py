"""Drained nodes in etcd: which nodes are being emptied, by when, and by whom.

A drain record says a node is to be emptied of job processes by its deadline (wall-clock seconds).
The controller reads them each pass (no new process goes to a draining node; what runs there leaves
at its safe point, ``policies.drain``); `erl drain` and `erl undrain` write them, and so does an erld
started with `--drain-on-term` when it gets SIGTERM (bound to its node lease: it ends with the node).
"""

from __future__ import annotations

import time
from typing import Any

from elastic_rl.store import keys
from elastic_rl.store.client import Store


async def drains(store: Store) -> dict[str, dict[str, Any]]:
    """Node -> its drain record, for every node being drained."""
    return {key[len(keys.DRAINS) :]: value for key, value in (await store.get_prefix(keys.DRAINS)).items()}


async def start_drain(store: Store, node: str, deadline_s: float, by: str, lease=None) -> dict[str, Any]:
    """Drain ``node`` within ``deadline_s`` seconds from now; a drain already under way keeps the earlier
    deadline (a second notice never buys time)."""
    now = time.time()
    record = {"since": now, "deadline": now + deadline_s, "by": by}
    current = await store.get(keys.drain(node))
    if current is not None and current["deadline"] <= record["deadline"]:
        return current
    await store.put(keys.drain(node), record, lease=lease)
    return record


async def end_drain(store: Store, node: str) -> bool:
    """Take ``node`` out of draining; False if it was not draining."""
    if await store.get(keys.drain(node)) is None:
        return False
    await store.delete(keys.drain(node))
    return True
