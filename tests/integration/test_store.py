"""The etcd layer against a real etcd: conditional writes, leases, and an unreachable endpoint."""

from __future__ import annotations

import asyncio

import pytest

from elastic_rl.net import free_port
from elastic_rl.store.client import Store, StoreUnavailable
from elastic_rl.store.embedded import EmbeddedEtcd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def etcd(tmp_path):
    server = EmbeddedEtcd(tmp_path, client_port=free_port())
    asyncio.run(server.start())
    yield server
    server.stop()


def test_concurrent_modifies_lose_no_update(etcd):
    async def scenario():
        async with Store(etcd.endpoint) as store:
            await store.put("/erl/counter", {"n": 0})
            await asyncio.gather(*(store.modify("/erl/counter", lambda v: {"n": v["n"] + 1}) for _ in range(20)))
            return await store.get("/erl/counter")

    assert asyncio.run(scenario()) == {"n": 20}


def test_create_only_once_and_lease_bound_keys_vanish(etcd):
    async def scenario():
        async with Store(etcd.endpoint) as store:
            lease = await store.lease(5)
            first = await store.create("/erl/leader", "a", lease=lease)
            second = await store.create("/erl/leader", "b")
            holder = await store.get("/erl/leader")
            await store.revoke(lease)
            return first, second, holder, await store.get("/erl/leader")

    assert asyncio.run(scenario()) == (True, False, "a", None)


def test_unreachable_etcd_names_the_endpoint():
    endpoint = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        async with Store(endpoint, timeout_s=1.0, attempts=2) as store:
            await store.get("/erl/anything")

    with pytest.raises(StoreUnavailable, match=endpoint):
        asyncio.run(scenario())
