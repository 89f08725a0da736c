"""erld as a cluster: three erlds on a three-member etcd sharing one work dir. A job spread over the
nodes completes; a node's death moves its work; the leader's death changes nothing that runs; a frozen
erld's processes never commit beside their replacements; an etcd member's death changes nothing, and
nor does etcd's whole outage."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections import Counter

import orjson
import pytest
import torch
from safetensors.torch import load_file

from chaos.topology import Topology
from checkpoints import layout
from elastic_rl.store.client import Store
from elastic_rl.store.devices import mark_failed
from tests.integration.erld_support import NO_POOL, erl, job_events, metrics, run_job, status
from tests.integration.test_replicas import assert_close_relative

pytestmark = [pytest.mark.integration]

ROLLOUTS = 10
TTL_S = 6  # the default is 10; 6 leaves an etcd election on a loaded machine room inside it


def job(rollouts: int = ROLLOUTS) -> list[str]:
    """The tiny job at two replicas, trained with PPO: the critic beside each replica's policy dies, heals
    or resumes, and is compared with it (its values steer the policy's advantages)."""
    return [
        "--set",
        "algorithm.advantage_estimator=ppo",
        "--set",
        "algorithm.critic.warmup_rollouts=1",
        "--set",
        f"rollout.num_rollouts={rollouts}",
        "--set",
        "rollout.prompts_per_rollout=16",  # half the example's, and half its global batch
        "--set",
        "trainer.global_batch_size=128",
        "--set",
        "trainer.replicas=2",
        "--set",
        "fault_tolerance.warm_spares=1",
        "--set",
        "engines.count=2",
        "--set",
        "checkpoints.keep_last=1000",
        "--set",
        "fault_tolerance.quorum_timeout_s=20",
    ]


def final_weights(workdir) -> dict[str, torch.Tensor]:
    return load_file(str(layout.weights_dir(workdir, ROLLOUTS) / "model.safetensors"))


def assert_every_rollout_once(workdir) -> None:
    """Committed once, trained once, every prompt of the run drawn once, each by one orchestrator."""
    assert layout.committed_rollouts(workdir) == list(range(ROLLOUTS))
    assert [line["rollout"] for line in metrics(workdir)] == list(range(ROLLOUTS))
    drawn = []
    writers = []
    for rollout_id in range(ROLLOUTS):
        folder = layout.rollout_dir(workdir, rollout_id)
        batch = load_file(str(folder / "batch.safetensors"))
        drawn += list(zip(batch["prompt_epochs"].tolist(), batch["prompt_indices"].tolist()))[::16]
        writers.append(orjson.loads((folder / "meta.json").read_bytes())["writer"]["generation"])
    assert max(Counter(drawn).values()) == 1
    assert writers == sorted(writers)  # a superseded orchestrator never wrote after its successor


def node_of(cluster: Topology, job_id: str, proc: str) -> str:
    return status(cluster, job_id)["procs"][proc]["node"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    topology = Topology.cluster(root, nodes=3, cpu_devices=4, lease_ttl_s=TTL_S, pool=NO_POOL)
    topology.nodes[0].metrics_port = free_metrics_port()
    with topology:
        yield topology


def free_metrics_port() -> int:
    from elastic_rl.net import free_port

    return free_port()


@pytest.fixture(scope="module")
def fault_free(cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fault-free")
    run_job(cluster, workdir, job())
    return workdir


@pytest.mark.timeout(300)
def test_a_job_spread_over_the_nodes_completes(cluster, fault_free):
    assert_every_rollout_once(fault_free)
    events = job_events(fault_free)
    started = next(e for e in events if e["kind"] == "job_started")
    assert len(started["nodes"]) == 3  # two replicas, the engines and the services spread out
    nodes = orjson.loads(erl("nodes", "-o", "json", "--etcd", cluster.endpoint, check=True).stdout)
    assert nodes["leader"] in {"node-0", "node-1", "node-2"} and len(nodes["nodes"]) == 3
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{cluster.nodes[0].metrics_port}/metrics", timeout=10).read()
    assert b"erld_is_leader" in scraped and b'erld_device_state{device="0",node="node-0"' in scraped
    assert urllib.request.urlopen(f"http://127.0.0.1:{cluster.nodes[0].metrics_port}/healthz", timeout=10).status == 200


@pytest.mark.timeout(420)
def test_a_dead_nodes_work_moves_and_the_run_ends_the_same(cluster, fault_free, tmp_path):
    victim = {}

    def kill_a_replicas_node() -> None:
        # The node of a replica without the services: the warm spare, on another node, takes its place.
        procs = status(cluster, "tiny-grpo")["procs"]
        services = procs["orchestrator"]["node"]
        victim["proc"] = next(p for p in ("trainer-1-0", "trainer-0-0") if procs[p]["node"] != services)
        victim["node"] = procs[victim["proc"]]["node"]
        assert victim["node"] != procs["spare-0-0"]["node"]
        victim["pids"] = cluster.node(victim["node"]).kill_node()

    run_job(cluster, tmp_path, job(), [(kill_a_replicas_node, 3)], timeout_s=400)
    assert_every_rollout_once(tmp_path)
    assert_close_relative(final_weights(fault_free), final_weights(tmp_path), 1e-5)
    events = job_events(tmp_path)
    promoted = [e for e in events if e["kind"] == "spare_promoted"]
    assert len(promoted) == 1 and promoted[0]["proc"] == victim["proc"]
    # The promoted spare joined the quorum (healed from its peer, or resumed from a snapshot already at
    # the quorum's step, whichever the timing gave); a new spare started on a live node.
    joined = ("replica_healed", "trainer_resumed")
    assert any(e["kind"] in joined and e["proc"] == victim["proc"] and e["time"] > promoted[0]["time"] for e in events)
    assert [e["participants"] for e in events if e["kind"] == "quorum_changed"][-1] == 2
    assert any(e["kind"] == "proc_started" and e["proc"] == "spare-0-0" and e["node"] != victim["node"] for e in events)
    cluster.node(victim["node"]).start()  # the machine comes back
    cluster.node(victim["node"]).wait_ready()


@pytest.mark.timeout(420)
def test_the_leader_an_etcd_member_and_then_etcd_itself_go_and_nothing_restarts(cluster, fault_free, tmp_path):
    """The leader killed, then one etcd member, then every live member frozen for three lease TTLs: the
    erlds' leases run out meanwhile, and they keep their processes (fenced) and rejoin."""
    timings = {}

    def kill_the_leader() -> None:
        leader = cluster.node(cluster.leader())
        timings["before"] = {n: p["pid"] for n, p in status(cluster, "tiny-grpo")["procs"].items()}
        killed = time.monotonic()
        leader.kill()
        leader.start()  # as systemd would, at once
        while cluster.leader() is None:
            time.sleep(0.05)
        timings["leaderless_s"] = time.monotonic() - killed
        leader.wait_ready()

    def kill_an_etcd_member() -> None:
        cluster.etcd.kill(0)

    def stop_etcd() -> None:
        live = [m.process for m in cluster.etcd.members if m.process is not None and m.process.poll() is None]
        for process in live:
            process.send_signal(signal.SIGSTOP)
        time.sleep(3 * TTL_S)
        for process in live:
            process.send_signal(signal.SIGCONT)

    faults = [(kill_the_leader, 2), (kill_an_etcd_member, 5), (stop_etcd, 7)]
    run_job(cluster, tmp_path, job(), faults, timeout_s=400)
    assert timings["leaderless_s"] <= TTL_S + 1
    assert_every_rollout_once(tmp_path)
    kinds = Counter(e["kind"] for e in job_events(tmp_path))
    assert not kinds["proc_exited"] and not kinds["proc_restarted"], kinds
    after = {n: p["pid"] for n, p in status(cluster, "tiny-grpo")["procs"].items()}
    assert {n: after[n] for n in timings["before"]} == timings["before"]  # adopted, not restarted
    assert_close_relative(final_weights(fault_free), final_weights(tmp_path), 1e-5)
    cluster.etcd.members[0].process = None
    restart_member(cluster)


def restart_member(cluster: Topology) -> None:
    """Bring the killed etcd member back, with its data, for the tests after this one."""
    import subprocess

    from elastic_rl.store.embedded import etcd_command

    member = cluster.etcd.members[0]
    initial = ",".join(m.peer for m in cluster.etcd.members)
    command = etcd_command(member.data_dir, member.client_port, member.peer_port, member.name, initial)
    command[command.index("new")] = "existing"
    member.process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


@pytest.mark.timeout(420)
def test_a_frozen_erlds_processes_never_commit_beside_their_replacements(cluster, tmp_path):
    frozen = {}

    def freeze_the_services_node() -> None:
        node = cluster.node(node_of(cluster, "tiny-grpo", "orchestrator"))
        frozen["node"], frozen["pids"] = node, node.job_pids()
        node.freeze()

    def thaw_once_moved(workdir) -> bool:
        if not any(e["kind"] == "services_moved" for e in job_events(workdir)):
            return False
        time.sleep(2 * TTL_S)  # its old processes run on beside their replacements meanwhile
        frozen["node"].thaw()
        return True

    run_job(cluster, tmp_path, job(), [(freeze_the_services_node, 2), (lambda: None, thaw_once_moved)], timeout_s=400)
    assert_every_rollout_once(tmp_path)
    moved = [e for e in job_events(tmp_path) if e["kind"] == "services_moved"]
    assert len(moved) == 1 and moved[0]["node"] != frozen["node"].name
    deadline = time.monotonic() + 30
    while frozen["pids"] & frozen["node"].job_pids():
        assert time.monotonic() < deadline, "the thawed erld left its old processes running"
        time.sleep(0.5)


@pytest.mark.timeout(120)
def test_a_failed_device_stays_failed_across_an_erld_restart(cluster):
    async def fail() -> None:
        async with Store(cluster.endpoint) as store:
            await mark_failed(store, "node-2", [3], "a test marked it")

    asyncio.run(fail())
    cluster.node("node-2").restart()
    nodes = orjson.loads(erl("nodes", "-o", "json", "--etcd", cluster.endpoint, check=True).stdout)
    node = next(n for n in nodes["nodes"] if n["node"] == "node-2")
    assert node["devices"][3]["state"] == "failed" and node["devices"][3]["reason"] == "a test marked it"
    assert erl("devices", "reset", "node-2", "3", "--etcd", cluster.endpoint, check=True).returncode == 0
    nodes = orjson.loads(erl("nodes", "-o", "json", "--etcd", cluster.endpoint, check=True).stdout)
    assert next(n for n in nodes["nodes"] if n["node"] == "node-2")["devices"][3]["state"] == "free"
    again = erl("devices", "reset", "node-2", "3", "--etcd", cluster.endpoint)
    assert again.returncode == 2
