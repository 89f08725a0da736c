"""Test doubles around the rollout-function example, given to jobs as `rollout.rollout_function:
tests.rollouts:<name>`."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from elastic_rl import jobenv
from elastic_rl.rollout.rollout_function import RolloutInput, RolloutSample
from examples.multi_turn_rollout import rollout

SETTLE_S = 0.6


def calls(workdir: Path, rollout_id: int) -> list[Path]:
    """The marks of the calls that made rollout ``rollout_id``'s samples, one per orchestrator."""
    return list(workdir.glob(f"rollout-function-{rollout_id}-*"))


async def multi_turn_then_settle(given: RolloutInput, engine) -> list[RolloutSample]:
    """The multi-turn example, which then marks the call in the job's work dir (by rollout and process)
    and takes SETTLE_S more before it returns: a test kills the orchestrator inside the function."""
    samples = await rollout(given, engine)
    (Path(os.environ[jobenv.WORKDIR]) / f"rollout-function-{given.rollout_id}-{os.getpid()}").touch()
    await asyncio.sleep(SETTLE_S)
    return samples
