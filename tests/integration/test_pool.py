"""erld's pre-imported interpreters under the faults the chaos library does: an idle one killed, one
killed while it takes its assignment, and erld killed with a full pool and started again. Nothing
leaks: the node runs as many pool interpreters after as before, and no job process is left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from daemon.pool import POOL_NODE
from elastic_rl import jobenv
from tests.integration.erld_support import job_events, run_job, running_daemon

pytestmark = [pytest.mark.integration]

POOL = {"trainer": 1, "orchestrator": 1, "engine": 2}
NODE = "test-node"


def alive_with(etcd: str, variable: str, value: str) -> list[psutil.Process]:
    """The live processes of the cluster on ``etcd`` that started with ``variable=value`` in their
    environment (another test session's cluster on this host may have a node and a job of the same name)."""
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            environ = process.environ()
            if (
                environ.get(variable) == value
                and environ.get(jobenv.ETCD) == etcd
                and process.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def started_by_the_pool(etcd: str) -> list[psutil.Process]:
    """This node's processes that began as pool interpreters: idle ones, and those that became a job's."""
    return alive_with(etcd, POOL_NODE, NODE)


def output(process: psutil.Process) -> str:
    """Where its errors go: the pool's log while idle, its job process's log once it became one."""
    try:
        return os.readlink(f"/proc/{process.pid}/fd/2")
    except OSError:
        return ""


def idle(etcd: str) -> list[psutil.Process]:
    return [process for process in started_by_the_pool(etcd) if "/pool-" in output(process)]


def job_processes(etcd: str, workdir) -> list[psutil.Process]:
    """The job's processes still alive: started cold (they carry the job in their environment) or from
    the pool (their output goes to the job's logs)."""
    from_pool = [process for process in started_by_the_pool(etcd) if str(workdir) in output(process)]
    return from_pool + alive_with(etcd, jobenv.JOB, "tiny-grpo")


def niceness(process: psutil.Process) -> set[int]:
    """The niceness of each of its threads (a thread's own on Linux) and of its session's autogroup
    (where the kernel schedules by autogroup); none if it is gone."""
    found = set()
    try:
        threads = process.threads()
        autogroup = Path(f"/proc/{process.pid}/autogroup")
        if autogroup.exists():
            found.add(int(autogroup.read_text().split()[-1]))  # "/autogroup-<id> nice <n>"
    except (psutil.NoSuchProcess, psutil.ZombieProcess, FileNotFoundError, ProcessLookupError):
        return set()
    for thread in threads:
        try:
            found.add(os.getpriority(os.PRIO_PROCESS, thread.id))
        except ProcessLookupError:
            continue  # the thread ended
    return found


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.timeout(400)
def test_the_pool_survives_kills_and_an_erld_restart_and_leaks_nothing(tmp_path):
    full = sum(POOL.values())
    with running_daemon(tmp_path, pool=POOL, metrics=True) as daemon:
        etcd = daemon.endpoint
        wait_for(lambda: len(idle(etcd)) == full, 60, "the pool never filled")
        # erld knows when an interpreter's imports are done, and says so in its /metrics.
        wait_for(lambda: daemon.nodes[0].ready_interpreters() == POOL, 120, "the pool never said it was ready")
        # Idle interpreters import at the lowest priority: they take only CPU the job leaves.
        wait_for(lambda: all(niceness(p) == {19} for p in idle(etcd)), 10, "an idle interpreter is not at nice 19")
        from_pool_priorities = []

        def kill_an_idle_interpreter() -> None:
            # The job's processes that were interpreters run at the normal priority, every thread.
            became = [p for p in started_by_the_pool(etcd) if str(tmp_path / "job") in output(p)]
            from_pool_priorities.extend(nice for nice in map(niceness, became) if nice)
            idle(etcd)[0].send_signal(signal.SIGKILL)

        # The job's first processes take the interpreters while they still import: the orchestrator,
        # killed at once, dies in the middle of taking its assignment.
        faults = [("orchestrator", 0), (kill_an_idle_interpreter, 2), ("erld", 4)]
        done = run_job(daemon, tmp_path / "job", ["--set", "rollout.num_rollouts=6"], faults)
        assert done == ["orchestrator", "kill_an_idle_interpreter", "erld"]
        events = job_events(tmp_path / "job")
        assert [e["kind"] for e in events if e.get("proc") == "orchestrator"].count("proc_restarted") == 1
        assert any(e["kind"] == "job_adopted" for e in events)
        assert from_pool_priorities and all(nice == {0} for nice in from_pool_priorities), from_pool_priorities
        # The restarted erld ended its predecessor's idle interpreters and filled its own pool; the job's
        # processes, adopted by it, ended with the job.
        wait_for(lambda: not job_processes(etcd, tmp_path / "job"), 30, "job processes outlived the job")
        wait_for(
            lambda: len(started_by_the_pool(etcd)) == len(idle(etcd)) == full, 60, "the pool is not back to its size"
        )
