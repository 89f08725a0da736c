"""The direct engine client's choice of engine, against fake engines: small HTTP servers that answer
/generate with their own name after a pause, so that requests overlap as a rollout's do."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from aiohttp import web

from elastic_rl.engines import direct
from elastic_rl.engines.direct import DirectEngineClient
from elastic_rl.net import free_port
from elastic_rl.store.client import StoreUnavailable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


async def fake_engine(name: str) -> tuple[web.AppRunner, str]:
    async def generate(request: web.Request) -> web.Response:
        await asyncio.sleep(0.05)
        return web.json_response({"text": name, "output_ids": [], "meta_info": {}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_requests_sent_at_once_are_spread_over_the_engines_and_a_dead_one_is_passed_over():
    async def scenario() -> tuple[Counter, int, Counter]:
        (runner_a, url_a), (runner_b, url_b) = await fake_engine("a"), await fake_engine("b")
        dead = f"http://127.0.0.1:{free_port()}"
        reads = 0

        async def directory() -> list[str]:
            nonlocal reads
            reads += 1
            return [url_a, url_b]

        try:
            async with DirectEngineClient(directory, timeout_s=5) as client:
                spread = Counter(r["text"] for r in await asyncio.gather(*(client.generate([1], {}) for _ in range(8))))

            async def with_a_dead_engine() -> list[str]:
                return [dead, url_a]

            after_a_death = DirectEngineClient(with_a_dead_engine, timeout_s=5)
            answered = Counter(
                r["text"] for r in await asyncio.gather(*(after_a_death.generate([1], {}) for _ in range(4)))
            )
        finally:
            await runner_a.cleanup()
            await runner_b.cleanup()
        return spread, reads, answered

    spread, reads, answered = asyncio.run(scenario())
    assert spread == {"a": 4, "b": 4}
    assert reads == 1  # one read of the engine list for the whole burst
    assert answered == {"a": 4}


def test_an_etcd_outage_leaves_the_engines_last_read_serving(monkeypatch):
    monkeypatch.setattr(direct, "DIRECTORY_REFRESH_S", 0.0)  # every call reads etcd

    async def scenario() -> list[str]:
        runner, url = await fake_engine("a")
        reads = []

        async def directory() -> list[str]:
            reads.append(None)
            if len(reads) > 1:
                raise StoreUnavailable("etcd at http://127.0.0.1:1 is unreachable (ConnectionFailedError)")
            return [url]

        try:
            async with DirectEngineClient(directory, timeout_s=5) as client:
                first = await client.generate([1], {})
                second = await client.generate([1], {})
        finally:
            await runner.cleanup()
        return [first["text"], second["text"], len(reads)]

    assert asyncio.run(scenario()) == ["a", "a", 2]


def test_no_engines_read_yet_and_etcd_out_is_an_error():
    async def directory() -> list[str]:
        raise StoreUnavailable("etcd at http://127.0.0.1:1 is unreachable (ConnectionFailedError)")

    async def scenario() -> None:
        async with DirectEngineClient(directory, timeout_s=5) as client:
            await client.generate([1], {})

    with pytest.raises(StoreUnavailable):
        asyncio.run(scenario())
