"""The controller at 100 nodes, and at 1,000 under `make chaos`: simulated erlds (real erld code, fake
processes) against a real etcd.

The figures at 10 to 1,000 nodes come from ``bench/controller_scale.py``; this checks what they rest on:
a job of 512 processes placed (more than one etcd transaction holds), a node's death re-placed, only
the erlds running the job following it, and nothing left behind of the dead node or of the stopped
job, its placement index included.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import pytest

from daemon.plan import SERVICES, proc_spec
from daemon.simulation import SimulatedCluster
from elastic_rl import jobs
from elastic_rl.net import free_port
from elastic_rl.spec.loading import load_spec
from elastic_rl.store import keys
from elastic_rl.store.devices import assignment_slots
from elastic_rl.store.embedded import EmbeddedEtcd
from tests.processes import SPEC

pytestmark = [pytest.mark.integration]

REPLICAS = 254  # 508 trainer ranks (TP=2), an engine and three services: 512 processes


@pytest.mark.parametrize(
    ("nodes", "lease_ttl_s"),
    [
        pytest.param(100, 3, marks=pytest.mark.timeout(240), id="100-nodes"),
        # One host runs the thousand erlds: erld's own lease TTL, so that none runs out on a busy loop.
        pytest.param(1000, 10, marks=[pytest.mark.chaos, pytest.mark.timeout(900)], id="1000-nodes"),
    ],
)
def test_a_512_process_job_survives_a_node_death_and_leaves_nothing(nodes, lease_ttl_s, tmp_path, caplog):
    caplog.set_level(logging.CRITICAL)  # the fake processes serve nothing: the agents' HTTP calls fail
    spec = load_spec(
        SPEC,
        [
            "name=big",
            f"trainer.replicas={REPLICAS}",
            "trainer.tensor_parallel=2",
            "trainer.micro_batch_size=16",
            f"trainer.global_batch_size={REPLICAS * 16}",
            f"rollout.prompts_per_rollout={REPLICAS}",
            "engines.count=1",
        ],
    )
    processes = 2 * REPLICAS + 4
    etcd = EmbeddedEtcd(tmp_path / "etcd", client_port=free_port())

    async def scenario():
        await etcd.start()
        async with SimulatedCluster(etcd.endpoint, nodes, tmp_path / "erlds", lease_ttl_s=lease_ttl_s) as cluster:
            store = cluster.observer
            await jobs.submit(store, spec, tmp_path / "work")
            await cluster.placed("big", processes, 120)
            await cluster.running("big", processes, 120)
            before = await cluster.assignments("big")
            following = {name for name, erld in cluster.erlds.items() if "big" in erld.records.statuses}

            leader = await store.get(keys.LEADER)
            services = {a["node"] for name, a in before.items() if proc_spec(name).group == SERVICES}
            dead = next(a["node"] for a in before.values() if a["node"] not in services | {leader})
            on_dead = {name for name, a in before.items() if a["node"] == dead}
            cluster.crash(dead)
            await cluster.node_gone(dead, 3 * lease_ttl_s)
            await cluster.replaced("big", dead, on_dead, 60)
            after = await cluster.assignments("big")
            status = await store.get(keys.job_status("big"))
            await asyncio.sleep(lease_ttl_s)  # the dead node's process records went with its lease
            reported = await store.get_prefix(keys.procs("big"))

            await jobs.stop(store, "big")

            async def nothing_left() -> bool:
                running = [r for r in (await store.get_prefix(keys.procs("big"))).values() if r["state"] == "running"]
                assigned = await store.get_prefix(keys.assignments("big"))
                indexed = await store.get_prefix(keys.PLACED)
                return await _phase_is(store, "stopped") and not assigned and not indexed and not running

            await cluster.until(nothing_left, 120, "the job stopped, its assignments gone, none of it running")
            return before, after, on_dead, dead, status, reported, leader, following

    try:
        before, after, on_dead, dead, status, reported, leader, following = asyncio.run(scenario())
    finally:
        etcd.stop()
    assert len(before) == processes and len(after) == processes
    assert status["phase"] == "running"
    assert on_dead and all(after[name]["node"] != dead for name in on_dead)
    # The others kept their places: only the dead node's processes moved.
    assert {name for name in before if after[name] != before[name]} == on_dead
    # No slot is given twice.
    held = Counter((a["node"], slot) for a in after.values() for slot in assignment_slots(a))
    assert max(held.values()) == 1
    assert not [record for record in reported.values() if record.get("node") == dead]
    # The job was followed by the leader and by the erlds it ran on, not by the others.
    assert following == {a["node"] for a in before.values()} | {leader}


async def _phase_is(store, phase: str) -> bool:
    return (await store.get(keys.job_status("big")))["phase"] == phase
