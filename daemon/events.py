"""Events: every failure, decision and recovery, in etcd and in ``workdir/events.jsonl``.

An event has a time, a kind, a message and, where they apply, the process,
device and step involved. `erl status` shows the recent ones.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import orjson

from elastic_rl.store import keys
from elastic_rl.store.client import Store

log = logging.getLogger("erld.events")


class EventLog:
    def __init__(self, store: Store, job_id: str, workdir: Path, node: str):
        self.store = store
        self.job_id = job_id
        self.path = workdir / "events.jsonl"
        self.node = node

    async def emit(self, kind: str, message: str, proc: str | None = None, **fields: Any) -> None:
        event = {"time": time.time(), "kind": kind, "message": message, "node": self.node, **fields}
        if proc is not None:
            event["proc"] = proc
        log.info("job %s: %s %s%s", self.job_id, kind, f"[{proc}] " if proc else "", message)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as handle:
            handle.write(orjson.dumps(event) + b"\n")
        await self.store.put(keys.event(self.job_id, time.time_ns()), event)


async def recent_events(store: Store, job_id: str, limit: int = 10) -> list[dict[str, Any]]:
    found = await store.get_prefix(keys.events(job_id))
    return [found[key] for key in sorted(found)[-limit:]]
