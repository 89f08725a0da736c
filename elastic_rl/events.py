"""Events: every failure, decision and recovery, in etcd and in ``workdir/events.jsonl``.

An event has a time, a kind, a message and, where they apply, the process,
device and step involved; its kind is one of ``EventKind``. `erl status` shows the recent ones. erld emits
through an ``EventLog``; a job's own processes (the trainer, say) through
``emit_event``, which finds the job from the environment erld gave them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import orjson

from checkpoints import layout
from elastic_rl import jobenv
from elastic_rl.event_kinds import EventKind
from elastic_rl.store import keys
from elastic_rl.store.client import Store, StoreUnavailable

log = logging.getLogger("elastic_rl.events")


class EventLog:
    def __init__(self, store: Store, job_id: str, workdir: Path, node: str):
        self.store = store
        self.job_id = job_id
        self.path = layout.events_path(workdir)
        self.node = node

    async def emit(self, kind: EventKind, message: str, proc: str | None = None, **fields: Any) -> None:
        """Record one event in events.jsonl and etcd (a store that fails raises ``StoreUnavailable`` after
        the file line is written). Raises ValueError for a kind not in ``EventKind``: readers match on it."""
        kind = EventKind(kind)
        event = {"time": time.time(), "kind": kind.value, "message": message, "node": self.node, **fields}
        if proc is not None:
            event["proc"] = proc
        log.info("job %s: %s %s%s", self.job_id, kind, f"[{proc}] " if proc else "", message)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as handle:
            handle.write(orjson.dumps(event) + b"\n")
        await self.store.put(keys.event(self.job_id, time.time_ns()), event)


def emit_event(kind: EventKind, message: str, proc: str, **fields: Any) -> None:
    """Emit an event from a job process (blocking; for rare events such as a skipped snapshot)."""

    async def emit() -> None:
        async with Store(os.environ[jobenv.ETCD]) as store:
            await EventLog(store, os.environ[jobenv.JOB], Path(os.environ[jobenv.WORKDIR]), node).emit(
                kind, message, proc=proc, **fields
            )

    node = socket.gethostname()
    try:
        asyncio.run(emit())
    except StoreUnavailable as exc:
        log.error("event %s not recorded in etcd (%s): %s", kind, exc, message)
