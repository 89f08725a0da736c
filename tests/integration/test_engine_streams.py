"""The cpu engine's streams while its steps run: every chunk a reader takes between two steps, or during
one, holds each token with its own log prob, so a streamed sample is exactly what the engine generated and
the trainer's log probs of it agree with the engine's."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from elastic_rl.engines.cpu_engine import CpuEngine
from elastic_rl.engines.streaming import Received

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STREAMS = 32
NEW_TOKENS = 48
PROMPT = [3, 4, 5]


class SlowDecode:
    """A test double around the engine's tokenizer: its decode gives up the interpreter for a while, as a
    long response's decode may, so that the engine's next step runs while a stream reads a chunk."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def decode(self, *args, **kwargs):
        time.sleep(0.0005)
        return self._tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


async def stream_all(engine: CpuEngine) -> list[tuple[Received, dict]]:
    """STREAMS seeded requests streamed at once, each read chunk by chunk; what each reader put together,
    and the engine's final answer."""
    runner = asyncio.create_task(engine.run())

    async def one(seed: int) -> tuple[Received, dict]:
        body = {
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "sampling_seed": seed},
            "return_logprob": True,
        }
        request = engine.make_request(body, PROMPT, None)
        received = Received()
        async for chunk in engine.stream(request, incremental=True):
            received.add(chunk)
        return received, request.done.result()

    try:
        return await asyncio.gather(*(one(seed) for seed in range(STREAMS)))
    finally:
        runner.cancel()


def test_a_stream_read_while_a_step_runs_holds_each_token_with_its_log_prob(checkpoints):
    v0, _ = checkpoints
    engine = CpuEngine(v0, max_batch_size=STREAMS, weight_version="0", deterministic=True)
    engine.tokenizer = SlowDecode(engine.tokenizer)
    streamed = asyncio.run(stream_all(engine))

    model = AutoModelForCausalLM.from_pretrained(str(v0), dtype=torch.float32).eval()
    for received, answer in streamed:
        assert received.output_ids == answer["output_ids"] and len(received.output_ids) == NEW_TOKENS
        assert received.logprobs == [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
        # What the trainer scores: the model's log prob of each streamed token after the ones before it.
        tokens = torch.tensor([PROMPT + received.output_ids])
        with torch.no_grad():
            log_probs = model(tokens).logits[0, len(PROMPT) - 1 : -1].log_softmax(-1)
        expected = log_probs.gather(1, tokens[0, len(PROMPT) :].unsqueeze(1)).squeeze(1)
        assert (torch.tensor(received.logprobs) - expected).abs().max().item() <= 1e-5
