"""The engine HTTP contract (SGLang's API), tested against a live server by URL.

By default each test module run starts a cpu engine on the tiny model. To run
the same tests unchanged against a real SGLang server:

    ERL_ENGINE_URL=http://127.0.0.1:30000 ERL_ENGINE_MODEL_PATH=/models/x \
        pytest tests/integration/test_engine_contract.py

``ERL_ENGINE_MODEL_PATH`` is the folder the weight-update test reloads;
``ERL_ENGINE_DETERMINISTIC=1`` says the server runs with deterministic inference,
which the seeded-repeat test needs.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.streaming import Received
from elastic_rl.errors import EngineError
from tests.processes import cpu_engines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROMPT = [5, 6, 7, 8, 9]
# Far longer than any test waits: such a request ends only when the test ends it.
LONG = {"max_new_tokens": 20000, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory) -> tuple[EngineClient, Path, bool]:
    """(client, a weights folder the engine can load, whether it is deterministic)."""
    external = os.environ.get("ERL_ENGINE_URL")
    if external:
        yield (
            EngineClient(external),
            Path(os.environ["ERL_ENGINE_MODEL_PATH"]),
            os.environ.get("ERL_ENGINE_DETERMINISTIC") == "1",
        )
        return
    v0, v1 = checkpoints
    with cpu_engines(v0, 1, tmp_path_factory.mktemp("logs")) as (server,):
        yield EngineClient(server.url), v1, True


def run(coro):
    return asyncio.run(coro)


async def _wait_running(client: EngineClient, task: asyncio.Task, seconds: float = 0.5) -> None:
    """Let a long request get going (and make sure it did not end already)."""
    await asyncio.sleep(seconds)
    assert not task.done(), "the long request ended before the test could act on it"


def test_generate_returns_sglang_shapes(engine):
    client, _, _ = engine
    result = run(client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0}, return_logprob=True))
    meta = result["meta_info"]
    assert isinstance(result["text"], str)
    assert 1 <= len(result["output_ids"]) <= 6
    assert meta["completion_tokens"] == len(result["output_ids"])
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert "weight_version" in meta
    logprobs = meta["output_token_logprobs"]
    assert [entry[1] for entry in logprobs] == result["output_ids"]
    assert all(entry[0] <= 0.0 for entry in logprobs)


def test_max_new_tokens_ends_with_length(engine):
    client, _, _ = engine
    result = run(client.generate(PROMPT, {"max_new_tokens": 5, "ignore_eos": True}))
    assert len(result["output_ids"]) == 5
    assert result["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_token_ids_end_generation(engine):
    client, _, _ = engine
    first = run(client.generate(PROMPT, {"max_new_tokens": 1, "temperature": 0}))["output_ids"][0]
    result = run(client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first]}))
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_a_stop_string_ends_generation_and_the_text_before_it(engine):
    client, _, deterministic = engine
    if not deterministic:
        pytest.skip("the server does not run with deterministic inference")
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5}
    text = run(client.generate(PROMPT, params))["text"]
    stop = text[6:8]
    result = run(client.generate(PROMPT, {**params, "stop": [stop]}))
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert result["text"] == text[: text.find(stop)]


def test_seeded_sampling_repeats_exactly(engine):
    client, _, deterministic = engine
    if not deterministic:
        pytest.skip("the server does not run with deterministic inference")
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 17}
    first, second = run(client.generate(PROMPT, params)), run(client.generate(PROMPT, params))
    assert first["output_ids"] == second["output_ids"]
    assert first["meta_info"]["output_token_logprobs"] == second["meta_info"]["output_token_logprobs"]


def test_concurrent_requests_all_complete(engine):
    client, _, _ = engine

    async def many():
        return await asyncio.gather(
            *(client.generate(PROMPT[: 2 + i % 4], {"max_new_tokens": 4 + i, "ignore_eos": True}) for i in range(8))
        )

    results = run(many())
    assert [len(r["output_ids"]) for r in results] == [4 + i for i in range(8)]


def test_abort_by_rid_returns_tokens_so_far(engine):
    client, _, _ = engine

    async def scenario():
        task = asyncio.create_task(client.generate(PROMPT, LONG, rid="abort-me"))
        await _wait_running(client, task)
        await client.abort(rid="abort-me")
        return await asyncio.wait_for(task, 30)

    result = run(scenario())
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(result["output_ids"]) < LONG["max_new_tokens"]
    assert len(result["meta_info"]["output_token_logprobs"]) == len(result["output_ids"])


def test_abort_all(engine):
    client, _, _ = engine

    async def scenario():
        tasks = [asyncio.create_task(client.generate(PROMPT, LONG)) for _ in range(3)]
        await _wait_running(client, tasks[0])
        await client.abort(abort_all=True)
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    results = run(scenario())
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)


def test_a_request_whose_client_went_away_is_aborted(engine):
    """A client that dies holding a request (the router, killed mid-rollout) leaves the engine no work:
    the engine aborts it instead of generating its 20000 tokens for nobody."""
    client, _, _ = engine

    async def scenario():
        task = asyncio.create_task(client.generate(PROMPT, LONG))
        await _wait_running(client, task)
        task.cancel()  # closes the connection
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            load = await client.load()
            if load is not None and not load.holding_work:
                return True
            await asyncio.sleep(0.2)
        return False

    assert run(scenario()), "the engine still holds the request of a client that went away"


async def _raw_stream(client: EngineClient, params: dict) -> list[bytes]:
    """The ``data:`` lines of a streamed /generate, as the server sent them."""
    body = {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{client.base_url}/generate", data=orjson.dumps(body)) as response:
            assert response.status == 200
            return [line.strip() for line in [raw async for raw in response.content] if line.startswith(b"data:")]


def test_a_streamed_request_sends_everything_so_far_in_each_chunk(engine):
    """SGLang's default (without --incremental-streaming-output): every chunk holds all the tokens so far
    and their log probs, completion_tokens counts them, the last says how the request ended, and
    ``data: [DONE]`` closes the stream. The streamed tokens are those of the same request unstreamed."""
    client, _, deterministic = engine
    params = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 11}
    lines = run(_raw_stream(client, params))
    assert lines[-1] == b"data: [DONE]"
    chunks = [orjson.loads(line[len(b"data:") :]) for line in lines[:-1]]
    counts = [chunk["meta_info"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 8 and len(chunks) >= 2
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert len(chunk["output_ids"]) == meta["completion_tokens"] == len(meta["output_token_logprobs"])
        assert chunk["output_ids"] == chunks[-1]["output_ids"][: meta["completion_tokens"]]
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    received = Received()
    answer = run(client.generate_stream(PROMPT, params, received))
    assert answer["output_ids"] == received.output_ids and len(received.logprobs) == 8
    if deterministic:
        whole = run(client.generate(PROMPT, params))
        assert received.output_ids == whole["output_ids"] == chunks[-1]["output_ids"]


def test_a_streamed_request_whose_client_went_away_is_aborted(engine):
    """A stream its reader drops (the orchestrator or the router, killed mid-rollout) is aborted."""
    client, _, _ = engine

    async def scenario():
        received = Received()
        task = asyncio.create_task(client.generate_stream(PROMPT, LONG, received))
        await _wait_running(client, task)
        assert received.output_ids, "no token streamed yet"
        task.cancel()  # closes the connection
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            load = await client.load()
            if load is not None and not load.holding_work:
                return True
            await asyncio.sleep(0.2)
        return False

    assert run(scenario()), "the engine still holds the streamed request of a client that went away"


def test_pause_in_place_then_continue(engine):
    client, _, _ = engine

    async def scenario():
        await client.pause_generation(mode="in_place")
        try:
            task = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True}))
            await asyncio.sleep(0.5)
            held = not task.done()
        finally:
            await client.continue_generation()
        return held, await asyncio.wait_for(task, 30)

    held, result = run(scenario())
    assert held, "a request finished while generation was paused"
    assert len(result["output_ids"]) == 4


def test_pause_abort_mode_aborts_running_requests(engine):
    client, _, _ = engine

    async def scenario():
        task = asyncio.create_task(client.generate(PROMPT, LONG))
        await _wait_running(client, task)
        await client.pause_generation(mode="abort")
        try:
            return await asyncio.wait_for(task, 30)
        finally:
            await client.continue_generation()

    assert run(scenario())["meta_info"]["finish_reason"]["type"] == "abort"


def test_update_weights_from_disk_sets_version(engine):
    client, weights, _ = engine

    async def scenario():
        answer = await client.update_weights_from_disk(str(weights), weight_version="contract-7")
        result = await client.generate(PROMPT, {"max_new_tokens": 2})
        return answer, result, await client.model_info()

    answer, result, info = run(scenario())
    assert answer["success"] is True
    assert result["meta_info"]["weight_version"] == "contract-7"
    assert info["weight_version"] == "contract-7"


def test_update_weights_waits_for_running_requests(engine):
    client, weights, _ = engine

    async def scenario():
        task = asyncio.create_task(client.generate(PROMPT, {**LONG, "max_new_tokens": 2000}))
        await _wait_running(client, task, 0.2)
        before = (await client.model_info())["weight_version"]
        await client.update_weights_from_disk(str(weights), weight_version="after-wait")
        return before, await task

    before, result = run(scenario())
    # The request in flight finished on the weights it started with.
    assert result["meta_info"]["finish_reason"]["type"] == "length"
    assert result["meta_info"]["weight_version"] == before


def test_health_endpoints(engine):
    client, _, _ = engine
    assert run(client.health())
    assert run(client.health_generate(timeout_s=30))


def test_flush_cache_and_info(engine):
    client, _, _ = engine
    run(client.flush_cache())
    assert run(client.model_info())["is_generation"] is True
    assert isinstance(run(client.server_info()), dict)


def test_unknown_sampling_param_is_rejected(engine):
    client, _, _ = engine
    with pytest.raises(EngineError, match="400"):
        run(client.generate(PROMPT, {"max_new_tokenz": 3}))


def test_engine_stays_responsive_while_generating(engine):
    """/health answers while a long generation runs: the scheduler does not block the server."""
    client, _, _ = engine

    async def scenario():
        task = asyncio.create_task(client.generate(PROMPT, LONG, rid="busy"))
        await _wait_running(client, task, 0.2)
        healthy = await client.health(timeout_s=5)
        await client.abort(rid="busy")
        await task
        return healthy

    assert run(scenario())


def test_the_load_shows_progress_while_generating_and_no_work_after(engine):
    """/metrics (SGLang's with --enable-metrics) carries the progress counter and the work held that
    erld's health check reads: while a long request runs the counter advances and work is held."""
    client, _, _ = engine

    async def scenario():
        idle = await client.load(timeout_s=5)
        task = asyncio.create_task(client.generate(PROMPT, LONG, rid="counted"))
        await _wait_running(client, task, 0.3)
        busy = await client.load(timeout_s=5)
        await asyncio.sleep(0.3)
        later = await client.load(timeout_s=5)
        await client.abort(rid="counted")
        await task
        return idle, busy, later, await client.load(timeout_s=5)

    idle, busy, later, after = run(scenario())
    assert busy.holding_work and later.holding_work
    assert idle.progress < busy.progress < later.progress <= after.progress
    assert not after.holding_work
