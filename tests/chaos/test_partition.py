"""A node cut off from etcd while it still reaches the other nodes (a partition through its own etcd proxy,
``chaos.etcd_proxy``). The leader's node: another erld leads within the lease's TTL and a second, and once
the partition heals the cut-off erld is a member again. A replica's node: its work moves, its old processes
run on fenced, and once the partition heals its erld ends them and the node is a member again.
``chaos/scenarios/partition.yaml`` checks the same job's invariants and weights against a fault-free run."""

from __future__ import annotations

import asyncio
import time

import pytest

from chaos.topology import Topology, _node_pid
from tests.integration.erld_support import NO_POOL, job_events, run_job, status

TTL_S = 2


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


@pytest.mark.chaos
@pytest.mark.timeout(180)
def test_another_erld_leads_within_a_ttl_and_a_second_of_the_leaders_partition(tmp_path):
    topology = Topology.cluster(
        tmp_path, nodes=3, cpu_devices=1, etcd_members=3, lease_ttl_s=TTL_S, pool=NO_POOL, partitionable=True
    )
    with topology:
        leader = wait_for(topology.leader, 30, "no erld took the leader key")
        cut_off = topology.node(leader)
        cut_off.link.cut()
        cut_at = time.monotonic()
        successor = wait_for(lambda: (now := topology.leader()) not in (None, leader) and now, 30, "nobody led")
        took = time.monotonic() - cut_at
        cut_off.link.heal()
        assert successor != leader and took <= TTL_S + 1, f"{successor} led {took:.2f} s after the partition"
        # Healed, the cut-off erld joins again under a new lease: its node record names its pid once more.
        wait_for(
            lambda: asyncio.run(_node_pid(topology.endpoint, cut_off.name)) == cut_off.process.pid,
            30,
            "the healed erld did not join again",
        )
        assert cut_off.process.poll() is None  # nothing ended it meanwhile


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_a_partitioned_nodes_old_processes_end_once_it_heals_and_it_joins_again(tmp_path):
    ttl_s = 4
    topology = Topology.cluster(
        tmp_path / "machines",
        nodes=3,
        cpu_devices=4,
        etcd_members=3,
        lease_ttl_s=ttl_s,
        pool=NO_POOL,
        partitionable=True,
    )
    cut: dict = {}

    def partition_replica_1s_node() -> None:
        node = topology.node(status(topology, "tiny-grpo")["procs"]["trainer-1-0"]["node"])
        cut["node"], cut["pids"] = node, node.job_pids()
        node.link.cut()

    def heal_once_moved(workdir) -> bool:
        if not any(e["kind"] == "replica_moved" for e in job_events(workdir)):
            return False
        time.sleep(2 * ttl_s)  # the old processes run on, fenced, beside their replacements
        cut["node"].link.heal()
        return True

    job = ["rollout.num_rollouts=12", "trainer.replicas=2", "fault_tolerance.quorum_timeout_s=20"]
    with topology:
        faults = [(partition_replica_1s_node, 2), (lambda: None, heal_once_moved)]
        run_job(topology, tmp_path / "job", [arg for override in job for arg in ("--set", override)], faults)
        node = cut["node"]
        assert cut["pids"], "the partitioned node ran none of the job's processes"
        wait_for(lambda: not (cut["pids"] & node.job_pids()), 30, "the healed erld left its old processes running")
        wait_for(
            lambda: asyncio.run(_node_pid(topology.endpoint, node.name)) == node.process.pid,
            30,
            "the healed erld did not join again",
        )
