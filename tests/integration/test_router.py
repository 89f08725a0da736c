"""Generation through the real sglang-router in front of two real cpu engines."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from elastic_rl.alongside import alongside
from elastic_rl.engines import pace
from elastic_rl.engines.access import EngineAccess
from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.pace import PaceMeter
from elastic_rl.engines.router import RouterClient
from elastic_rl.engines.streaming import Received
from tests.processes import cpu_engines, router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def stack(checkpoints, tmp_path):
    """Two engines on version-0 weights behind a router: (router client, engine servers)."""
    v0, _ = checkpoints
    with cpu_engines(v0, 2, tmp_path) as engines, router(engines, tmp_path) as front:
        yield RouterClient(front.url), engines


def test_generation_with_logprobs_through_router(stack):
    client, engines = stack

    async def scenario():
        results = await asyncio.gather(
            *(client.generate(PROMPT, {"max_new_tokens": 6, "ignore_eos": True}) for _ in range(6))
        )
        return results, await client.worker_urls()

    results, workers = asyncio.run(scenario())
    assert workers == {engine.url for engine in engines}
    for result in results:
        logprobs = result["meta_info"]["output_token_logprobs"]
        assert len(result["output_ids"]) == 6
        assert [entry[1] for entry in logprobs] == result["output_ids"]
        assert all(entry[0] <= 0 for entry in logprobs)


def test_request_in_flight_survives_engine_kill(stack):
    """SIGKILL the engine serving a request: the router retries it on the other engine."""
    client, engines = stack
    params = {"max_new_tokens": 300, "ignore_eos": True}

    async def serving_engine():
        for engine in engines:
            if (await EngineClient(engine.url).server_info())["running_requests"]:
                return engine
        return None

    async def scenario():
        task = asyncio.create_task(client.generate(PROMPT, params))
        victim = None
        while victim is None:
            assert not task.done(), "the request finished before an engine could be killed"
            await asyncio.sleep(0.05)
            victim = await serving_engine()
        victim.kill()
        return victim, await asyncio.wait_for(task, 60)

    victim, result = asyncio.run(scenario())
    assert victim.process.wait(timeout=10) != 0
    assert len(result["output_ids"]) == params["max_new_tokens"]
    assert result["meta_info"]["finish_reason"]["type"] == "length"


def test_weight_update_changes_outputs_and_version(stack, checkpoints):
    client, engines = stack
    _, v1 = checkpoints
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}

    async def scenario():
        before = await client.generate(PROMPT, params)
        for engine in engines:
            answer = await EngineClient(engine.url).update_weights_from_disk(str(v1), weight_version="1")
            assert answer["success"]
        after = [await client.generate(PROMPT, params) for _ in engines]
        return before, after

    before, after = asyncio.run(scenario())
    assert before["meta_info"]["weight_version"] == "0"
    for result in after:
        assert result["meta_info"]["weight_version"] == "1"
        assert result["output_ids"] != before["output_ids"]
        assert result["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]


def test_remove_and_add_worker(stack):
    client, engines = stack
    gone, kept = engines

    async def scenario():
        await client.remove_worker(gone.url)
        after_remove = await client.worker_urls()
        results = [await client.generate(PROMPT, {"max_new_tokens": 3}) for _ in range(3)]
        await client.add_worker(gone.url)
        return after_remove, results, await client.worker_urls()

    after_remove, results, after_add = asyncio.run(scenario())
    assert after_remove == {kept.url}
    assert all(r["output_ids"] for r in results)
    assert after_add == {gone.url, kept.url}


@contextmanager
def slowed(engine, stopped_s: float = 0.15, period_s: float = 0.2):
    """The engine stopped (SIGSTOP) ``stopped_s`` of every ``period_s``: about a quarter of its speed."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            engine.kill(signal.SIGSTOP)
            time.sleep(stopped_s)
            engine.kill(signal.SIGCONT)
            time.sleep(period_s - stopped_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        engine.kill(signal.SIGCONT)


async def finished_requests(engine) -> int:
    load = await EngineClient(engine.url).load()
    return load.progress - load.generated_tokens


def test_a_slow_engine_gets_fewer_requests_and_is_not_restarted(stack, monkeypatch):
    """One engine at a fifth of its speed behind the real router: once measured, it gets new requests in
    proportion to its pace, every request still completes, and it is never restarted."""
    # Loads read five times a second rather than once: the fast engine's share of a round takes about a
    # second on the tiny model, and a pace is known only after five reads that saw it running.
    monkeypatch.setattr(pace, "POLL_S", 0.2)
    client, engines = stack
    fast, slow = engines
    params = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}
    changes = []

    async def changed(before, after):
        changes.append(after)

    async def scenario():
        async with RouterClient(client.base_url) as router_client:
            meter = PaceMeter(2.0)
            access = EngineAccess(router_client, None, meter)

            async def one_round() -> list[dict]:
                return await asyncio.gather(*(access.generate_stream(PROMPT, params, Received()) for _ in range(10)))

            load = lambda url, timeout_s: router_client.client_for(url).load(timeout_s)  # noqa: E731
            async with alongside(meter.run(access.worker_urls, load, changed)):
                for _ in range(10):  # until the slow engine has been measured
                    await one_round()
                    if meter.verdict.shares is not None:
                        break
                before = {engine.url: await finished_requests(engine) for engine in engines}
                results = await one_round()
                after = {engine.url: await finished_requests(engine) for engine in engines}
        return meter, results, {url: after[url] - before[url] for url in after}

    # A fifth of its speed: a peer given more requests runs each of them slower on the same cores, and the
    # slow engine stays past the factor of 2 while the two share the rollout.
    with slowed(slow, stopped_s=0.16):
        meter, results, served = asyncio.run(scenario())
    assert meter.verdict.slow(2.0) == [slow.url] and changes and changes[0].slow(2.0) == [slow.url], (
        meter.verdict.ratios,
        [change.ratios for change in changes],
    )
    assert all(len(result["output_ids"]) == params["max_new_tokens"] for result in results)
    assert served[fast.url] + served[slow.url] == 10
    assert served[slow.url] <= 3 < served[fast.url]
    assert slow.process.poll() is None and fast.process.poll() is None
