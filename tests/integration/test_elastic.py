"""Elastic capacity on real erlds and a three-member etcd: a job whose replicas are a range
(`trainer.replicas: {min: 1, max: 3}`) starts on one node, grows into two erlds that join mid-run, goes
on with fewer when one of their nodes is drained (`erl drain`: the replica leaves the quorum after a
rollout, nothing is redone), and with one after `erl scale --replicas 1`, ending where the same job at
a fixed single replica ends (the gradient does not depend on how many replicas share a step)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import orjson
import pytest
from safetensors.torch import load_file

from chaos.invariants import check_nothing_redone
from chaos.topology import Topology
from checkpoints import layout
from elastic_rl.net import free_port
from tests.integration.erld_support import NO_POOL, erl, job_events, metrics, run_job, status
from tests.integration.test_replicas import assert_close_relative

pytestmark = [pytest.mark.integration]

ROLLOUTS = 50  # long enough for a dead node's lease to run out, and a scale-down, well before the end
TTL_S = 6


def job(replicas: str) -> list[str]:
    return [
        "--set",
        f"rollout.num_rollouts={ROLLOUTS}",
        "--set",
        "rollout.prompts_per_rollout=16",
        "--set",
        "trainer.global_batch_size=128",
        "--set",
        f"trainer.replicas={replicas}",
        "--set",
        "checkpoints.keep_last=1000",
        "--set",
        "fault_tolerance.quorum_timeout_s=20",
        # A replica killed inside a cross-replica all-reduce holds the survivors for this long (gloo on
        # CPU): the default 60 s would be most of the test.
        "--set",
        "fault_tolerance.collective_timeout_s=10",
    ]


def scrape(topology: Topology, wanted: str, timeout_s: float = 10.0) -> str:
    """node-0's /metrics once it shows ``wanted`` (erld renders what its last pass read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        url = f"http://127.0.0.1:{topology.nodes[0].metrics_port}/metrics"
        scraped = urllib.request.urlopen(url, timeout=10).read().decode()
        if wanted in scraped or time.monotonic() > deadline:
            assert wanted in scraped, scraped
            return scraped
        time.sleep(0.3)


def events_so_far(workdir: Path) -> list[dict]:
    path = workdir / "events.jsonl"
    return [orjson.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def quorum_of(size: int):
    def reached(workdir: Path) -> bool:
        return any(e["kind"] == "quorum_changed" and e["participants"] == size for e in events_so_far(workdir))

    reached.__name__ = f"a quorum of {size}"
    return reached


@pytest.mark.timeout(480)
def test_a_ranged_job_grows_into_joining_nodes_and_shrinks_out_of_a_drained_one(tmp_path):
    root = tmp_path / "cluster"
    # node-0's three slots hold the two engines and replica-0 (the services take none).
    topology = Topology.cluster(root, nodes=1, cpu_devices=3, lease_ttl_s=TTL_S, pool=NO_POOL)
    topology.nodes[0].metrics_port = free_port()
    with topology:
        fixed, elastic = tmp_path / "fixed", tmp_path / "elastic"
        run_job(topology, fixed, job("1"))

        def two_nodes_join() -> None:
            topology.join(1)
            topology.join(1)

        drained: list[str] = []

        def replica_2s_node_drains() -> None:
            unknown = erl("drain", "node-9", "--etcd", topology.endpoint)
            assert unknown.returncode == 2 and "no live node 'node-9'" in unknown.stderr
            drained.append(status(topology, "tiny-grpo")["procs"]["trainer-2-0"]["node"])
            erl("drain", drained[0], "--deadline", "120", "--etcd", topology.endpoint, check=True)
            nodes = orjson.loads(erl("nodes", "-o", "json", "--etcd", topology.endpoint, check=True).stdout)
            assert [n["node"] for n in nodes["nodes"] if n["drain"]] == drained
            scraped = scrape(topology, f'erld_node_drain_seconds_left{{node="{drained[0]}"}}')
            assert 'erld_job_size{bound="max",job="tiny-grpo",kind="replicas"} 3.0' in scraped

        def scaled_to_one() -> None:
            outside = erl("scale", "tiny-grpo", "--replicas", "1:4", "--etcd", topology.endpoint)
            assert outside.returncode == 2 and "the most the job was submitted for" in outside.stderr
            erl("scale", "tiny-grpo", "--replicas", "1", "--etcd", topology.endpoint, check=True)

        def shrunk(workdir: Path) -> bool:
            return any(e["kind"] == "replica_removed" for e in events_so_far(workdir))

        run_job(
            topology,
            elastic,
            job("{min: 1, max: 3}"),
            [(two_nodes_join, 2), (replica_2s_node_drains, quorum_of(3)), (scaled_to_one, shrunk)],
            timeout_s=420,
        )
        final = status(topology, "tiny-grpo")["status"]
        erl("undrain", drained[0], "--etcd", topology.endpoint, check=True)
        again = erl("undrain", drained[0], "--etcd", topology.endpoint)
        assert again.returncode == 2 and "is not draining" in again.stderr

    # Every rollout trained once, and the weights are the fixed job's.
    assert layout.committed_rollouts(elastic) == list(range(ROLLOUTS))
    assert [line["rollout"] for line in metrics(elastic)] == list(range(ROLLOUTS))
    weights = [load_file(str(layout.weights_dir(run, ROLLOUTS) / "model.safetensors")) for run in (fixed, elastic)]
    assert_close_relative(*weights, 1e-5)

    events = job_events(elastic)
    started = next(e for e in events if e["kind"] == "job_started")
    assert started["nodes"] == ["node-0"]
    added = [e for e in events if e["kind"] == "replica_added"]
    assert sorted(e["group"] for e in added) == ["replica-1", "replica-2"], added
    assert {e["node"] for e in added} == {"node-1", "node-2"}
    removed = [e for e in events if e["kind"] == "replica_removed"]
    assert [e["group"] for e in removed] == ["replica-2", "replica-1"], removed  # its node drained; then scaled
    assert not [e for e in events if e["kind"] == "replica_degraded"], events
    # The drain redid nothing: the replica left after a rollout; no process crashed, no step was trained twice.
    kinds = [e["kind"] for e in events]
    assert "node_draining" in kinds and "node_drained" in kinds and "replica_left" in kinds, kinds
    nothing_redone = check_nothing_redone(events)
    assert nothing_redone.held, nothing_redone.detail
    quorums = [e["participants"] for e in events if e["kind"] == "quorum_changed"]
    assert quorums[0] == 1 and 3 in quorums and 2 in quorums and quorums[-1] == 1, quorums
    assert final["phase"] == "succeeded" and final["size"]["replicas"] == [1, 1, 1], final
