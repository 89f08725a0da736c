"""The trainer process: one tensor-parallel rank of one replica (``trainer.replica``).

    started by erld as: python -m elastic_rl.trainer.main
    (ERL_* variables from jobenv; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for the replica's TP group)
"""

from __future__ import annotations

import logging
import time

from elastic_rl import jobenv
from elastic_rl.trainer.replica import StopRequest, TrainerReplica

# Wall-clock time once the imports are done: a resume's first cost.
IMPORTS_DONE = time.time()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    replica = TrainerReplica(jobenv.JobEnv.from_environ(), StopRequest(), IMPORTS_DONE)
    replica.write_initial_weights()
    if not replica.take_place():
        return  # a warm spare stopped before it was needed
    replica.join()
    replica.run()


if __name__ == "__main__":
    main()
