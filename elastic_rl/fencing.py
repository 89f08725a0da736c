"""Whether a job process is still the one its assignment names: a process whose assignment moved on never commits.

erld starts each process with the generation of its assignment
(``ERL_GENERATION``). Before it commits anything the job keeps (a rollout to
the log, exported weights, a snapshot) a process reads its assignment from
etcd: a newer generation, or none, means another instance has taken its place
(its node's lease ran out, say, and the controller moved its work), and it
exits without committing. While etcd answers nothing it waits: a commit it
cannot confirm might be a second writer's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from elastic_rl import jobenv
from elastic_rl.store import keys
from elastic_rl.store.client import Store, StoreUnavailable
from policies.exits import EXIT_SUPERSEDED

log = logging.getLogger("elastic_rl.fencing")

RETRY_S = 1.0


class Assignment:
    def __init__(self, job: str, proc: str, generation: int, endpoint: str):
        self.job, self.proc, self.generation, self.endpoint = job, proc, generation, endpoint

    @classmethod
    def from_environ(cls) -> Assignment:
        return cls(
            os.environ[jobenv.JOB],
            os.environ[jobenv.PROC],
            int(os.environ.get(jobenv.GENERATION, "0")),
            os.environ[jobenv.ETCD],
        )

    def take_over(self, proc: str, generation: int) -> None:
        """A warm spare promoted to ``proc`` holds that assignment from now on."""
        self.proc, self.generation = proc, generation

    async def current(self, store: Store) -> bool:
        while True:
            try:
                assignment = await store.get(keys.assignment(self.job, self.proc))
                return assignment is not None and assignment["generation"] == self.generation
            except StoreUnavailable as exc:
                log.warning("cannot confirm the assignment of %s (%s); waiting", self.proc, exc)
                await asyncio.sleep(RETRY_S)

    async def exit_if_superseded(self, store: Store) -> None:
        if not await self.current(store):
            log.error(
                "%s generation %d is superseded by a newer assignment: exiting without committing",
                self.proc,
                self.generation,
            )
            sys.exit(EXIT_SUPERSEDED)

    def exit_if_superseded_blocking(self) -> None:
        """The same, from synchronous code (the trainer), over a connection of its own."""

        async def check() -> None:
            async with Store(self.endpoint) as store:
                await self.exit_if_superseded(store)

        asyncio.run(check())
