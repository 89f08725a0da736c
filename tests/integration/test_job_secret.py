"""The job's secret on a real cpu engine and the real sglang-router: without it, nothing changes state."""

from __future__ import annotations

import asyncio

import aiohttp
import psutil
import pytest

from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.router import RouterClient
from elastic_rl.errors import EngineRejected
from tests.processes import cpu_engines, router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SECRET = "a-job-secret-made-for-this-test"
PROMPT = [5, 6, 7, 8, 9]


async def status_without_secret(method: str, url: str, body: dict | None = None) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, json=body) as response:
            return response.status


def test_state_changing_endpoints_refuse_a_caller_without_the_secret(checkpoints, tmp_path):
    v0, v1 = checkpoints
    with cpu_engines(v0, 1, tmp_path, secret=SECRET) as engines, router(engines, tmp_path, secret=SECRET) as front:
        engine_url = engines[0].url
        keyed_engine, keyed_router = EngineClient(engine_url, secret=SECRET), RouterClient(front.url, secret=SECRET)

        async def scenario() -> dict:
            refused = {
                path: await status_without_secret("POST", f"{engine_url}{path}", body)
                for path, body in [
                    ("/update_weights_from_disk", {"model_path": str(v1), "weight_version": "1"}),
                    ("/pause_generation", {"mode": "abort"}),
                    ("/abort_request", {"abort_all": True}),
                    ("/flush_cache", None),
                    ("/release_memory_occupation", None),  # were it released, the keyed generate below would wait
                    ("/resume_memory_occupation", None),
                    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
                ]
            }
            refused["router POST /workers"] = await status_without_secret(
                "POST", f"{front.url}/workers", {"url": "http://127.0.0.1:9"}
            )
            worker = f"{front.url}/workers/{(await keyed_router.list_workers())[0]['id']}"
            refused["router DELETE /workers"] = await status_without_secret("DELETE", worker)
            refused["router /generate"] = await status_without_secret("POST", f"{front.url}/generate", {"text": "a"})
            with pytest.raises(EngineRejected, match="401"):
                await EngineClient(engine_url).update_weights_from_disk(str(v1), "1")
            return {
                "refused": refused,
                "open": [
                    await status_without_secret("GET", f"{engine_url}{path}")
                    for path in ("/health", "/health_generate", "/metrics")
                ],
                "version": (await keyed_engine.model_info())["weight_version"],
                "workers": await keyed_router.worker_urls(),
                # With the secret, through the router: the router carries it on to the engine.
                "generated": await keyed_router.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True}),
            }

        seen = asyncio.run(scenario())
        assert seen["refused"] == dict.fromkeys(seen["refused"], 401)
        assert seen["open"] == [200, 200, 200]
        assert seen["version"] == "0"  # the refused update changed nothing
        assert seen["workers"] == {engine_url}  # nor the refused worker add and remove
        assert len(seen["generated"]["output_ids"]) == 3
        # The router took the secret from its environment: its command line, readable by any user, lacks it.
        assert not any(SECRET in part for part in psutil.Process(front.process.pid).cmdline())
