"""The cpu engine's batched decoder: samples of one prompt that join together are prefilled once, and
each then continues on its own as if it had been prefilled alone."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from elastic_rl.engines.decoders import BatchedDecoder

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Sequence:
    """A request's tokens so far, as the decoder sees it."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)

    def token_ids(self) -> list[int]:
        return self.tokens


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def alone(model, tokens: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """The logits of a sequence prefilled and decoded by itself."""
    decoder, sequence = BatchedDecoder(model, pad_token_id=0), Sequence(tokens)
    logits = [decoder.step([sequence])[sequence]]
    for token in continuation:
        sequence.tokens.append(token)
        logits.append(decoder.step([sequence])[sequence])
    return logits


@torch.no_grad()
def test_samples_of_one_prompt_share_a_prefill_and_continue_apart(model):
    prompt, other = [5, 6, 7, 8, 9], [11, 12, 13]
    continuations = {0: [20, 21, 22], 1: [30, 31, 32], 2: [40, 41, 42]}
    sequences = [Sequence(prompt), Sequence(prompt), Sequence(other)]
    decoder = BatchedDecoder(model, pad_token_id=0)
    got = {index: [] for index in continuations}
    rows = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    first = decoder.step(sequences)
    hook.remove()
    assert rows == [2]  # one prefill row for the prompt's two samples
    for index, sequence in enumerate(sequences):
        got[index].append(first[sequence])
    for step in range(3):
        for index, sequence in enumerate(sequences):
            sequence.tokens.append(continuations[index][step])
        logits = decoder.step(sequences)
        for index, sequence in enumerate(sequences):
            got[index].append(logits[sequence])
    for index, start in enumerate([prompt, prompt, other]):
        expected = alone(model, start, continuations[index])
        for mine, theirs in zip(got[index], expected):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
    # The two samples of the prompt went apart after their shared prefill.
    assert not torch.allclose(got[0][-1], got[1][-1])
