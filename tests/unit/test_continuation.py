"""A seeded sample cut at any position and continued on a fresh deterministic cpu engine is the sample
generated in one go: the same tokens and bit for bit the same log probabilities (the engine, in process,
on a small random Llama checkpoint)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from elastic_rl.engines.cpu_engine import CpuEngine
from elastic_rl.model.tokenizer import as_transformers, build_tokenizer, padded_vocab_size, save_tokenizer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

NEW_TOKENS = 40
PROMPTS = [[3, 11, 7], [5, 9, 2, 14, 6, 1, 8], [12]]
SEEDS = [101, 202, 303]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    tokenizer = as_transformers(build_tokenizer())
    config = LlamaConfig(
        vocab_size=padded_vocab_size(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a sharper distribution than the near-uniform initial one: varied tokens
        model.lm_head.weight.mul_(40)
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


@contextlib.asynccontextmanager
async def serving(checkpoint: Path):
    engine = CpuEngine(checkpoint, max_batch_size=8, weight_version="0", deterministic=True)
    loop = asyncio.create_task(engine.run())
    try:
        yield engine
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


async def generate(engine: CpuEngine, input_ids: list[int], seed: int, new_tokens: int) -> tuple[list, list]:
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0, "sampling_seed": seed}
    request = engine.make_request({"sampling_params": params, "return_logprob": True}, input_ids, None)
    result = await engine.generate(request)
    return result["output_ids"], [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


def test_a_continued_sample_is_the_uninterrupted_one(checkpoint):
    async def run() -> None:
        async with serving(checkpoint) as engine:
            whole = await asyncio.gather(*(generate(engine, p, s, NEW_TOKENS) for p, s in zip(PROMPTS, SEEDS)))
        assert len({tuple(tokens) for tokens, _ in whole}) == len(PROMPTS)
        for cut in (1, 2, 9, 23, NEW_TOKENS - 1):
            async with serving(checkpoint) as engine:
                # Each continuation prefilled beside the others, and beside a request already decoding.
                other = asyncio.ensure_future(generate(engine, [4, 4], 7, NEW_TOKENS))
                await asyncio.sleep(0)
                continued = await asyncio.gather(
                    *(
                        generate(engine, prompt + tokens[:cut], seed, NEW_TOKENS - cut)
                        for prompt, seed, (tokens, _) in zip(PROMPTS, SEEDS, whole)
                    )
                )
                await other
            for (tokens, logprobs), (rest, rest_logprobs) in zip(whole, continued):
                assert rest == tokens[cut:], cut
                assert rest_logprobs == logprobs[cut:], cut

    asyncio.run(run())
