"""The cpu engine on SmolLM2-135M-Instruct, as erld starts it (streaming incrementally): its log
probabilities are the model's, and in deterministic mode a seeded request's tokens do not depend on what
else the engine serves, nor on whether it was continued from some of its tokens, nor on its memory having
been released and resumed (colocated mode's handover)."""

from __future__ import annotations

import asyncio
import math
import subprocess

import psutil
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.launcher import engine_command
from elastic_rl.engines.streaming import Received
from elastic_rl.net import free_port
from elastic_rl.spec.engines import EnginesSpec
from tests.processes import SMOLLM2, Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Prompts of different lengths, so the batched engine pads and merges.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [900, 901], [42] * 17, [3000, 7, 7, 7, 12]]


@pytest.fixture(params=[False, True], ids=["batched", "deterministic"], scope="module")
def smollm2_engine(request, tmp_path_factory):
    assert (SMOLLM2 / "config.json").is_file(), f"{SMOLLM2} is missing: run `make models`"
    port = free_port()
    command = engine_command(
        EnginesSpec(kind="cpu"), SMOLLM2, port, deterministic=request.param, incremental_streaming=True
    )
    log = open(tmp_path_factory.mktemp("logs") / "engine.log", "wb")
    server = Server(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), port)
    try:
        asyncio.run(EngineClient(server.url).wait_healthy(120, server.process))
        yield EngineClient(server.url), request.param, server.process.pid
    finally:
        server.stop()


def generate_all(client: EngineClient, prompts: list[list[int]], seeds: list[int], tokens: int = 12) -> list[dict]:
    async def all_at_once():
        return await asyncio.gather(
            *(
                client.generate(
                    p, {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": s}
                )
                for p, s in zip(prompts, seeds)
            )
        )

    return asyncio.run(all_at_once())


def test_engine_log_probs_are_the_models(smollm2_engine):
    """Within 1e-4 of a plain forward of transformers; 1e-3 for the batched engine, whose left-padded
    batches sum in another order (logits differ by ~5e-5 after the prefill already)."""
    client, deterministic, _ = smollm2_engine
    tolerance = 1e-4 if deterministic else 1e-3
    results = generate_all(client, PROMPTS, seeds=[1, 2, 3, 4])
    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2), dtype=torch.float32).eval()
    for prompt, result in zip(PROMPTS, results):
        tokens = torch.tensor([prompt + result["output_ids"]])
        with torch.no_grad():
            log_probs = model(tokens).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        expected = log_probs.gather(1, torch.tensor(result["output_ids"]).unsqueeze(1)).squeeze(1)
        reported = torch.tensor([entry[0] for entry in result["meta_info"]["output_token_logprobs"]])
        assert (reported - expected).abs().max().item() <= tolerance


# Only the deterministic engine: batched mode makes no such promise.
@pytest.mark.parametrize("smollm2_engine", [True], ids=["deterministic"], indirect=True)
def test_deterministic_tokens_do_not_depend_on_the_other_requests(smollm2_engine):
    client, _, _ = smollm2_engine
    (alone,) = generate_all(client, PROMPTS[:1], seeds=[9])
    crowded = generate_all(client, PROMPTS * 2, seeds=[9, 5, 6, 7, 8, 10, 11, 12])[0]
    assert crowded["output_ids"] == alone["output_ids"]
    assert crowded["meta_info"]["output_token_logprobs"] == alone["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("smollm2_engine", [True], ids=["deterministic"], indirect=True)
def test_a_stream_cut_anywhere_continues_as_the_uninterrupted_request(smollm2_engine):
    """Streamed incrementally, the chunks add up to the unstreamed answer; the same request continued from
    its first tokens (on a busy engine) gives the rest, bit for bit."""
    client, _, _ = smollm2_engine
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 21}
    (whole,) = generate_all(client, PROMPTS[:1], seeds=[21], tokens=16)
    received = Received()
    asyncio.run(client.generate_stream(PROMPTS[0], params, received))
    assert received.output_ids == whole["output_ids"]
    assert received.logprobs == [entry[0] for entry in whole["meta_info"]["output_token_logprobs"]]

    async def continued(cut: int) -> dict:
        rest = {**params, "max_new_tokens": 16 - cut}
        others = [client.generate(p, {**params, "sampling_seed": 3}) for p in PROMPTS[1:]]
        answers = await asyncio.gather(client.generate(PROMPTS[0] + whole["output_ids"][:cut], rest), *others)
        return answers[0]

    for cut in (1, 7, 15):
        rest = asyncio.run(continued(cut))
        assert rest["output_ids"] == whole["output_ids"][cut:]
        assert rest["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"][cut:]


@pytest.mark.parametrize("smollm2_engine", [True], ids=["deterministic"], indirect=True)
def test_released_memory_is_given_back_and_the_resumed_engine_serves_the_same_tokens(smollm2_engine):
    """After /release_memory_occupation the engine's resident memory is down by at least half the model
    as it serves it (float32); a request sent meanwhile waits, and after /resume_memory_occupation it
    gets the tokens and log probabilities it got before the release."""
    client, _, pid = smollm2_engine
    served_bytes = 0
    for file in SMOLLM2.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as weights:
            served_bytes += 4 * sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    (before,) = generate_all(client, PROMPTS[:1], seeds=[33])
    resident = psutil.Process(pid).memory_info().rss
    asyncio.run(client.release_memory_occupation())
    released = psutil.Process(pid).memory_info().rss
    assert resident - released >= served_bytes / 2, (resident, released, served_bytes)

    async def sent_while_released() -> dict:
        params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 33}
        waiting = asyncio.ensure_future(client.generate(PROMPTS[0], params))
        await asyncio.sleep(1.0)
        assert not waiting.done()
        await client.resume_memory_occupation()
        return await waiting

    after = asyncio.run(sent_while_released())
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
