"""The trainer process: one tensor-parallel rank of one replica (``trainer.replica``).

    started by erld as: python -m elastic_rl.trainer.main
    (ERL_* variables from jobenv; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for the replica's TP group)

The exit code it ends with is also written to the work dir (``exit_record``),
for an erld that adopted it and cannot ``wait`` for it.

A trainer that cannot run where it was placed (its spec refused there, e.g.
bf16 on a CPU slot, or a GPU slot and a torch without CUDA), or a committed
rollout it cannot train (``RolloutLogError``), reports why and
exits ``EXIT_GAVE_UP``: erld fails the job with that reason rather than
restarting it on the same slot until its restart budget is spent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import NoReturn

from elastic_rl import exit_record, jobenv
from elastic_rl.errors import RolloutLogError, SpecError, WrongDevice
from elastic_rl.event_kinds import EventKind
from elastic_rl.progress import ProgressReporter
from elastic_rl.store.client import StoreUnavailable
from elastic_rl.trainer.replica import StopRequest, TrainerReplica
from policies.exits import EXIT_GAVE_UP

# Wall-clock time once the imports are done: a resume's first cost.
IMPORTS_DONE = time.time()

log = logging.getLogger("elastic_rl.trainer")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    env = jobenv.JobEnv.from_environ()
    try:
        run(env)
    except SystemExit as exc:  # the codes erld acts on: rollback, quarantine, drained, gave up
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1  # as Python exits
        exit_record.write(env.workdir, code)
        raise
    exit_record.write(env.workdir, 0)


def run(env: jobenv.JobEnv) -> None:
    try:
        replica = TrainerReplica(env, StopRequest(), IMPORTS_DONE)
    except (SpecError, WrongDevice) as exc:
        give_up(env, str(exc))
    replica.write_initial_weights()
    if not replica.take_place():
        return  # a warm spare stopped before it was needed
    replica.join()
    try:
        replica.run()
    except RolloutLogError as exc:  # a rollout it cannot train: every restart would meet it again
        give_up(env, str(exc))


def give_up(env: jobenv.JobEnv, reason: str) -> NoReturn:
    log.error("giving up: %s", reason)

    async def report() -> None:
        async with ProgressReporter.connect(env.job, os.environ.get(jobenv.ETCD), env.workdir) as progress:
            await progress.give_up(reason, proc=os.environ.get(jobenv.PROC, "trainer"), kind=EventKind.TRAINER_GAVE_UP)

    try:
        asyncio.run(report())
    except StoreUnavailable as exc:  # erld still fails the job, naming this log instead of the reason
        log.error("the reason was not recorded in etcd: %s", exc)
    sys.exit(EXIT_GAVE_UP)


if __name__ == "__main__":
    main()
