"""The etcd layer against a real etcd: conditional writes, leases, and an unreachable endpoint."""

from __future__ import annotations

import asyncio

import pytest

from elastic_rl.net import free_port
from elastic_rl.store.client import Store, StoreUnavailable
from elastic_rl.store.embedded import EmbeddedEtcd
from elastic_rl.store.mirror import Mirror

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


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within the time"
        await asyncio.sleep(0.02)


class HeardKeys:
    """A mirror's listener that keeps what it hears as key -> value, as erld's parsed records do."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def reset(self, prefix: str, entries: dict) -> None:
        self.values = {key: value for key, value in self.values.items() if not key.startswith(prefix)} | entries

    def changed(self, prefix: str, key: str, value) -> None:
        if value is None:
            self.values.pop(key, None)
        else:
            self.values[key] = value


def test_a_mirror_follows_its_prefixes_and_writes_applied_ahead_of_the_watch(etcd):
    async def scenario():
        async with Store(etcd.endpoint) as writer, Store(etcd.endpoint) as reader:
            await writer.put("/erl/jobs/a/status", {"phase": "pending"})
            await writer.put("/erl/other/x", 1)  # not mirrored
            heard = HeardKeys()
            mirror = Mirror(reader, ("/erl/jobs/", "/erl/leader"), heard)
            await mirror.start()
            try:
                assert heard.values == {"/erl/jobs/a/status": {"phase": "pending"}}
                await writer.put("/erl/jobs/a/status", {"phase": "running"})
                await writer.put("/erl/jobs/b/status", {"phase": "pending"})
                await writer.delete("/erl/jobs/b/status")
                await writer.put("/erl/leader", "node-0")
                await until(lambda: mirror.get_with_revision("/erl/leader")[0] == "node-0")
                assert heard.values == {"/erl/jobs/a/status": {"phase": "running"}, "/erl/leader": "node-0"}

                # A write this process made, applied at its revision: the older changes the watch still
                # brings afterwards do not undo it, nor bring back a key it deleted.
                value, revision = mirror.get_with_revision("/erl/jobs/a/status")
                mirror.applied({"/erl/jobs/a/status": {"phase": "stopped"}}, ("/erl/leader",), revision + 100)
                mirror._apply("/erl/jobs/", "/erl/jobs/a/status", {"phase": "running"}, revision + 1)
                mirror._apply("/erl/leader", "/erl/leader", "node-1", revision + 2)
                assert heard.values == {"/erl/jobs/a/status": {"phase": "stopped"}}
                assert mirror.get_with_revision("/erl/leader") == (None, 0)
            finally:
                await mirror.stop()

    asyncio.run(scenario())


def test_a_mirror_follows_and_drops_prefixes_as_its_needs_change(etcd):
    """An agent follows one job, then the whole of /erl/jobs/ as a leader, then one other job again."""

    async def scenario():
        async with Store(etcd.endpoint) as writer, Store(etcd.endpoint) as reader:
            await writer.put("/erl/jobs/a/status", "a")
            await writer.put("/erl/jobs/b/status", "b")
            heard = HeardKeys()
            mirror = Mirror(reader, ("/erl/leader",), heard)
            await mirror.start()
            try:
                await mirror.follow("/erl/jobs/a/")
                assert heard.values == {"/erl/jobs/a/status": "a"}
                await writer.put("/erl/jobs/a/status", "a2")
                await until(lambda: heard.values.get("/erl/jobs/a/status") == "a2")

                await mirror.follow("/erl/jobs/")  # the narrower prefix gives way to it
                assert mirror.prefixes == ("/erl/leader", "/erl/jobs/")
                await mirror.follow("/erl/jobs/b/")  # under one followed already: nothing to do
                assert mirror.prefixes == ("/erl/leader", "/erl/jobs/")
                await writer.put("/erl/jobs/b/status", "b2")
                await until(lambda: heard.values == {"/erl/jobs/a/status": "a2", "/erl/jobs/b/status": "b2"})

                mirror.unfollow("/erl/jobs/")
                assert heard.values == {}
                await mirror.follow("/erl/jobs/b/")
                await writer.put("/erl/jobs/a/status", "a3")  # no longer followed
                await writer.put("/erl/jobs/b/status", "b3")
                await until(lambda: heard.values.get("/erl/jobs/b/status") == "b3")
                assert heard.values == {"/erl/jobs/b/status": "b3"}
            finally:
                await mirror.stop()

    asyncio.run(scenario())


def test_a_mirror_reads_afresh_when_its_watch_breaks(tmp_path):
    port = free_port()
    first, again = EmbeddedEtcd(tmp_path, client_port=port), EmbeddedEtcd(tmp_path, client_port=port)

    async def scenario():
        await first.start()
        async with Store(first.endpoint, timeout_s=1.0) as writer, Store(first.endpoint, timeout_s=1.0) as reader:
            heard = HeardKeys()
            mirror = Mirror(reader, ("/erl/nodes/",), heard)
            await mirror.start()
            try:
                await writer.put("/erl/nodes/a", 1)
                await until(lambda: "/erl/nodes/a" in heard.values)
                first.stop()  # the watch's stream breaks
                await again.start()
                await writer.put("/erl/nodes/b", 2)
                await until(lambda: heard.values == {"/erl/nodes/a": 1, "/erl/nodes/b": 2}, 30)
                return mirror.resyncs
            finally:
                await mirror.stop()

    try:
        assert asyncio.run(scenario()) >= 1
    finally:
        first.stop()
        again.stop()
