"""The `erl` command line, run as a subprocess from the repository root: how the chaos harness (its
fault loop, the `scale_engines` fault), the integration tests and the benchmarks drive a job.

``erl`` runs one command and returns the finished process. ``job_status`` is what `erl status JOB
-o json` prints, read in this process: the fault loop and the tests poll it several times a second,
and a CLI process per poll would take most of a core from the job on a small machine. It waits through
an etcd outage, which a scenario may inject.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

from chaos.topology import REPO
from elastic_rl import jobs
from elastic_rl.store.client import Store, StoreUnavailable

OUTAGE_WAIT_S = 300.0


def erl(*args: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_rl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=check,
    )


def job_status(endpoint: str, job: str, outage_s: float = OUTAGE_WAIT_S) -> dict[str, Any]:
    """The job as `erl status` shows it; through an etcd outage (a fault under test) it waits, up to
    ``outage_s``, as `erl run` does."""

    async def describe() -> dict[str, Any]:
        async with Store(endpoint) as store:
            return await jobs.describe(store, job)

    deadline = time.monotonic() + outage_s
    while True:
        try:
            return asyncio.run(describe())
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
