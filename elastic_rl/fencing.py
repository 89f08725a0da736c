"""Whether a job process is still the one its assignment names: a process whose assignment moved on never commits.

erld starts each process with the generation of its assignment
(``ERL_GENERATION``). Before it commits anything the job keeps (a rollout to
the log, a metrics line, exported weights, a snapshot) a process reads its assignment from
etcd: a newer generation, or none, means another instance has taken its place
(its node's lease ran out, say, and the controller moved its work), and it
exits without committing. While etcd answers nothing it waits: a commit it
cannot confirm might be a second writer's.

The same read tells a process whether its node is being drained: an assignment
the controller marked ``drain`` asks it to leave at its next safe point
(``policies.drain``), which is right after such a check.
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

    async def read(self, store: Store) -> dict | None:
        """The assignment as etcd holds it now, if it is still this process's; None if superseded."""
        while True:
            try:
                assignment = await store.get(keys.assignment(self.job, self.proc))
                return assignment if assignment is not None and assignment["generation"] == self.generation else None
            except StoreUnavailable as exc:
                log.warning("cannot confirm the assignment of %s (%s); waiting", self.proc, exc)
                await asyncio.sleep(RETRY_S)

    async def exit_if_superseded(self, store: Store) -> bool:
        """Exit if superseded; else whether the assignment asks this process to leave its draining node."""
        assignment = await self.read(store)
        if assignment is None:
            log.error(
                "%s generation %d is superseded by a newer assignment: exiting without committing",
                self.proc,
                self.generation,
            )
            sys.exit(EXIT_SUPERSEDED)
        return "drain" in assignment

    def exit_if_superseded_blocking(self) -> bool:
        """The same, from synchronous code (the trainer), over a connection of its own."""

        async def check() -> bool:
            async with Store(self.endpoint) as store:
                return await self.exit_if_superseded(store)

        return asyncio.run(check())
