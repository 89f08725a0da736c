"""A warm spare's wait for its place: imports done and model built, it waits until erld gives it a
dead replica's place by writing the spare's assignment file in the work dir."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from checkpoints import layout

log = logging.getLogger("elastic_rl.trainer")

POLL_INTERVAL_S = 0.01


@dataclass(frozen=True)
class Place:
    """The replica a spare takes over, and the generation of that replica's assignment."""

    replica: int
    generation: int


def wait_for_place(workdir: Path, spare: str, stopped: Callable[[], bool]) -> Place | None:
    """The place erld gives the spare named ``spare``; None if a stop came first."""
    path = layout.spare_assignment_path(workdir, spare)
    log.info("warm spare %s ready", spare)
    while not path.is_file():
        if stopped():
            return None
        time.sleep(POLL_INTERVAL_S)
    given = orjson.loads(path.read_bytes())
    return Place(int(given["replica"]), int(given["generation"]))
