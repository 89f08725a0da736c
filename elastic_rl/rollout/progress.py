"""The orchestrator's progress report: the job's progress key in etcd.

Outside erld (no etcd endpoint) the reporter is a null object that does nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from elastic_rl.store import keys
from elastic_rl.store.client import Store


class ProgressReporter:
    def __init__(self, job: str, store: Store | None):
        self.job = job
        self.store = store

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, job: str, endpoint: str | None) -> AsyncIterator[ProgressReporter]:
        if endpoint is None:
            yield cls(job, None)
            return
        async with Store(endpoint) as store:
            yield cls(job, store)

    async def report(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        if self.store is None:
            return
        await self.store.put(
            keys.job_progress(self.job),
            {
                "rollouts_done": rollout_id + 1,
                "weight_version": rollout_id + 1,
                "reward_mean": metrics.get("rollout/reward_mean"),
                "metrics": metrics,
                "finished": False,
                "time": time.time(),
            },
        )

    async def finish(self) -> None:
        if self.store is None:
            return
        progress = await self.store.get(keys.job_progress(self.job)) or {}
        await self.store.put(keys.job_progress(self.job), {**progress, "finished": True, "time": time.time()})
