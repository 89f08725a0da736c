"""What a person at the terminal meets: Ctrl-C on `erl run`, a second erld for a node that has one,
an erld started again on the etcd its dead predecessor left, stopping the background erld, finished jobs kept
in `erl list --all`, the demo's own folder."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import orjson
import pytest

from elastic_rl.net import free_port
from elastic_rl.store import keys
from elastic_rl.store.client import Store
from elastic_rl.store.embedded import EmbeddedEtcd
from tests.integration.erld_support import erl, status
from tests.processes import REPO, SPEC

pytestmark = [pytest.mark.integration]

LONG_JOB = ["--set", "rollout.num_rollouts=500"]


def start_run(daemon, workdir) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastic_rl.cli",
            "run",
            str(SPEC),
            *LONG_JOB,
            "--workdir",
            str(workdir),
            "--etcd",
            daemon.endpoint,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_rollouts(daemon, workdir, count: int, timeout_s: float = 120) -> dict:
    """Until the job in ``workdir`` (submitted by an `erl run` starting up meanwhile) has trained
    ``count`` rollouts; an earlier job of the same name does not count."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = erl("status", "tiny-grpo", "-o", "json", "--etcd", daemon.endpoint)
        info = orjson.loads(listed.stdout) if listed.returncode == 0 else {"progress": {}, "status": {}}
        ours = info["status"].get("workdir") == str(workdir)
        if ours and info["progress"].get("rollouts_done", 0) >= count:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.3)


@pytest.mark.timeout(400)
def test_ctrl_c_a_second_erld_and_the_job_history(daemon, tmp_path):
    run = start_run(daemon, tmp_path / "first")
    before = wait_rollouts(daemon, tmp_path / "first", 1)
    run.send_signal(signal.SIGINT)
    output, _ = run.communicate(timeout=30)
    # One Ctrl-C: erl says the job runs on and how to stop it; it does run on.
    assert run.returncode == 130
    assert "keeps running under erld" in output and "erl stop tiny-grpo" in output
    assert status(daemon, "tiny-grpo")["status"]["phase"] == "running"

    # A second erld for this node, as `erl daemon` with the first one's state dir: refused, and the
    # first one's etcd, job and processes carry on untouched.
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_rl.cli",
            "daemon",
            "--state-dir",
            str(daemon.nodes[0].state_dir),
            "--etcd-port",
            str(daemon.nodes[0].etcd_port),
            "--cpu-devices",
            "8",
            "--node",
            "test-node",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2 and "held by a live erld" in second.stderr, second.stderr
    after = wait_rollouts(daemon, tmp_path / "first", before["progress"]["rollouts_done"] + 2)
    assert {n: p["pid"] for n, p in after["procs"].items()} == {n: p["pid"] for n, p in before["procs"].items()}
    assert all(p["restarts"] == 0 for p in after["procs"].values())

    erl("stop", "tiny-grpo", "--etcd", daemon.endpoint, check=True)
    while status(daemon, "tiny-grpo")["status"]["phase"] != "stopped":
        time.sleep(0.3)

    # The same name again: two quick Ctrl-Cs stop the job.
    run = start_run(daemon, tmp_path / "second")
    wait_rollouts(daemon, tmp_path / "second", 1)
    run.send_signal(signal.SIGINT)
    time.sleep(1.0)
    run.send_signal(signal.SIGINT)
    output, _ = run.communicate(timeout=30)
    assert run.returncode == 130
    assert status(daemon, "tiny-grpo")["status"]["phase"] in ("stopping", "stopped")
    # The first run is still listed, with its own work dir.
    listed = orjson.loads(erl("list", "--all", "-o", "json", "--etcd", daemon.endpoint, check=True).stdout)
    assert [(row["job"], row["workdir"]) for row in listed] == [
        ("tiny-grpo", str(tmp_path / "first")),
        ("tiny-grpo", str(tmp_path / "second")),
    ]
    assert len(orjson.loads(erl("list", "-o", "json", "--etcd", daemon.endpoint, check=True).stdout)) == 1


@pytest.mark.timeout(120)
def test_erl_shutdown_stops_the_background_erld(tmp_path):
    state_dir, port = tmp_path / "erld", free_port()
    state_dir.mkdir()
    # As `erl run` starts it: its own session, its pid in the state dir.
    background = subprocess.Popen(
        [sys.executable, "-m", "elastic_rl.cli", "daemon", "--state-dir", str(state_dir), "--etcd-port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    (state_dir / "erld.pid").write_text(str(background.pid))
    deadline = time.monotonic() + 60
    while erl("list", "--etcd", f"http://127.0.0.1:{port}").returncode != 0:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    stopped = erl("shutdown", "--state-dir", str(state_dir), timeout=90)
    assert stopped.returncode == 0, stopped.stderr
    assert background.wait(timeout=10) == 0
    again = erl("shutdown", "--state-dir", str(state_dir))
    assert again.returncode == 1 and "no background erld" in again.stderr


@pytest.mark.timeout(180)
def test_the_demo_writes_its_own_folder(tmp_path):
    demo = subprocess.run(
        [sys.executable, "-m", "elastic_rl.demo", str(SPEC)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert (tmp_path / "runs" / "tiny-grpo-demo" / "weights" / "1" / "config.json").is_file()
    assert not (tmp_path / "runs" / "tiny-grpo").exists()  # a job's work dir of that spec stays untouched


@pytest.mark.timeout(120)
def test_an_erld_on_the_etcd_it_left_takes_its_node_back(tmp_path):
    """An erld that died with its embedded etcd (a reboot) left its node record under a lease that etcd
    restores, with a fresh TTL, when it starts again. The new erld, whose own etcd it is, takes the
    name over, whatever the record says (here: written by an older erld, with no host or pid)."""
    state, port = tmp_path / "erld-state", free_port()
    etcd = EmbeddedEtcd(state, client_port=port)
    asyncio.run(etcd.start())

    async def leave_a_record() -> None:
        async with Store(etcd.endpoint) as store:
            await store.put(keys.node("vm"), {"devices": [0, 1]}, lease=await store.lease(600))

    asyncio.run(leave_a_record())
    etcd.stop()

    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastic_rl.cli",
            "daemon",
            "--state-dir",
            str(state),
            "--etcd-port",
            str(port),
            "--cpu-devices",
            "2",
            "--node",
            "vm",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    async def holder_pid() -> int | None:
        async with Store(etcd.endpoint, attempts=1) as store:
            return ((await store.get(keys.node("vm"))) or {}).get("pid")

    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "erld exited: it took the old record for a live erld's"
            try:
                if asyncio.run(holder_pid()) == process.pid:
                    break
            except Exception:  # its etcd is still starting
                pass
            assert time.monotonic() < deadline, "erld never held its node"
            time.sleep(0.3)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
