"""A job process's reports: the job's progress key in etcd, and its events.

The orchestrator reports its rollouts through it; a trainer that gives up reports through it too,
so it sits beside ``events`` rather than in either process's package.

Outside erld (no etcd endpoint) progress goes nowhere and events only to the log.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from checkpoints.layout import version_after
from elastic_rl.event_kinds import EventKind
from elastic_rl.events import EventLog
from elastic_rl.store import keys
from elastic_rl.store.client import Store

log = logging.getLogger("elastic_rl.orchestrator")


class ProgressReporter:
    def __init__(self, job: str, store: Store | None, workdir: Path):
        self.job = job
        self.store = store
        self.events = EventLog(store, job, workdir, socket.gethostname()) if store is not None else None

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, job: str, endpoint: str | None, workdir: Path) -> AsyncIterator[ProgressReporter]:
        if endpoint is None:
            yield cls(job, None, workdir)
            return
        async with Store(endpoint) as store:
            yield cls(job, store, workdir)

    async def event(self, kind: EventKind, message: str, proc: str = "orchestrator", **fields: Any) -> None:
        if self.events is None:
            log.info("%s: %s", kind, message)
            return
        await self.events.emit(kind, message, proc=proc, **fields)

    async def report(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        if self.store is None:
            return
        await self.store.put(
            keys.job_progress(self.job),
            {
                "rollouts_done": rollout_id + 1,
                "weight_version": version_after(rollout_id),
                "reward_mean": metrics.get("rollout/reward_mean"),
                "metrics": metrics,
                "finished": False,
                "time": time.time(),
            },
        )

    async def give_up(
        self, reason: str, proc: str = "orchestrator", kind: EventKind = EventKind.ORCHESTRATOR_GAVE_UP
    ) -> None:
        """A failure budget ran out, or a process cannot run where it was placed: say why, for erld to
        fail the job with it (the process then exits ``EXIT_GAVE_UP``)."""
        await self.event(kind, reason, proc=proc)
        if self.store is None:
            return
        progress = await self.store.get(keys.job_progress(self.job)) or {}
        await self.store.put(keys.job_progress(self.job), {**progress, "failure": reason, "time": time.time()})

    async def finish(self) -> None:
        if self.store is None:
            return
        progress = await self.store.get(keys.job_progress(self.job)) or {}
        await self.store.put(keys.job_progress(self.job), {**progress, "finished": True, "time": time.time()})
