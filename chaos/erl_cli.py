"""The `erl` command line, run as a subprocess from the repository root: how the chaos harness (its
fault loop, the `scale_engines` fault), the integration tests and the benchmarks drive a job.

``erl`` runs one command and returns the finished process; ``job_status`` is
`erl status JOB -o json` read back as a dict.
"""

from __future__ import annotations

import subprocess
import sys

import orjson

from chaos.topology import REPO


def erl(*args: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_rl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=check,
    )


def job_status(endpoint: str, job: str) -> dict:
    return orjson.loads(erl("status", job, "-o", "json", "--etcd", endpoint, check=True).stdout)
