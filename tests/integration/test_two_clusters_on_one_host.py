"""Two clusters' erlds on one host, with nodes of the same name running jobs of the same name (two users'
`erl run` of the same example, each with its own embedded etcd): each erld's clean-up of what a dead
predecessor left ends its own cluster's processes and never the other's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from daemon.pool import POOL_NODE, InterpreterPool
from daemon.proctable import LocalProc, ProcessTable
from elastic_rl import jobenv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

NODE = "test-node"
OURS, THEIRS = "http://127.0.0.1:23001", "http://127.0.0.1:23002"


@pytest.fixture
def sleeper() -> Iterator:
    """Starts a process that sleeps with the given environment, in its own session as erld starts them
    (Popen returns once the child has exec'd, so /proc already shows that environment)."""
    started: list[subprocess.Popen] = []

    def start(environment: dict[str, str]) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            env={**os.environ, **environment},
            start_new_session=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def ended(process: subprocess.Popen) -> bool:
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_an_orphan_of_this_cluster_is_killed_and_the_other_clusters_process_of_the_same_name_lives(sleeper):
    job = {jobenv.JOB: "tiny-grpo", jobenv.PROC: "lighthouse", jobenv.NODE: NODE}
    ours = sleeper({**job, jobenv.ETCD: OURS})
    theirs = sleeper({**job, jobenv.ETCD: THEIRS})
    ProcessTable(NODE, OURS).kill_strays(LocalProc(job="tiny-grpo", name="lighthouse", generation=1))
    assert ended(ours)
    assert theirs.poll() is None


def test_a_dead_erlds_pool_interpreters_end_and_the_other_clusters_live(sleeper, tmp_path):
    ours = sleeper({POOL_NODE: NODE, jobenv.ETCD: OURS})
    theirs = sleeper({POOL_NODE: NODE, jobenv.ETCD: THEIRS})
    assert InterpreterPool(NODE, {}, tmp_path, {}, OURS).end_leftovers(adopted=set()) == 1
    assert ended(ours)
    assert theirs.poll() is None
