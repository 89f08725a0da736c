"""The trainer's log probs: from bf16 logits the temperature is applied in fp32, so they match the
fp32 path; scored from the first response position on, they and their gradients are unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megatron.core import parallel_state

from elastic_rl.model import sequence_log_probs as module
from elastic_rl.model.gpt import build_gpt, destroy_model_parallel, init_model_parallel
from elastic_rl.model.token_scores import Entropy, scores_of_logits
from elastic_rl.net import free_port
from elastic_rl.spec.model import ModelSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def single_rank_model_parallel():
    """Megatron's groups at tensor-parallel size 1, over a one-process gloo group in this process."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_bf16_logits_give_the_fp32_log_probs_of_the_same_values(single_rank_model_parallel):
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 64, (2, 8), generator=generator)
    exact = (torch.randn(2, 8, 64, generator=generator) * 8).bfloat16()  # values bf16 holds exactly
    temperature = 0.7  # a quotient bf16 would round
    logp_bf16, ent_bf16 = scores_of_logits(exact, targets, temperature, Entropy.LOSS)
    logp_fp32, ent_fp32 = scores_of_logits(exact.float(), targets, temperature, Entropy.LOSS)
    assert logp_bf16.dtype == torch.float32 and ent_bf16.dtype == torch.float32
    torch.testing.assert_close(logp_bf16, logp_fp32, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_bf16, ent_fp32, rtol=0, atol=1e-6)


@pytest.fixture
def tiny_gpt():
    """A real two-layer megatron GPTModel with tied embeddings, at tensor-parallel size 1, in this process."""
    init_model_parallel(1, seed=3, init_method=f"tcp://127.0.0.1:{free_port()}")
    spec = ModelSpec(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48)
    yield build_gpt(replace(spec.toy_architecture(64), tie_embeddings=True))
    destroy_model_parallel()


def test_scoring_from_the_first_response_position_gives_the_same_log_probs_and_gradients(tiny_gpt):
    """Logits are computed only from the micro-batch's shortest prompt on; the responses' log
    probs, the loss's gradient and the entropy metric do not change."""
    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    first = 5
    response = torch.zeros(tokens.shape)
    response[:, first:] = 1.0

    def scored(first_position: int, entropy: Entropy):
        tiny_gpt.zero_grad()
        logp, ent = module.sequence_log_probs(tiny_gpt, tokens, 0.9, first_position, entropy)
        loss = (logp * response).sum() + 0.1 * (ent.detach() * response).sum()
        loss.backward()
        return logp.detach(), ent.detach(), [p.grad.clone() for p in tiny_gpt.parameters()]

    logp_all, ent_all, grads_all = scored(1, Entropy.LOSS)
    logp_cut, ent_cut, grads_cut = scored(first, Entropy.METRIC)
    assert bool((logp_cut[:, :first] == 0).all()) and bool((ent_cut[:, :first] == 0).all())
    torch.testing.assert_close(logp_cut[:, first:], logp_all[:, first:], rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_cut[:, first:], ent_all[:, first:], rtol=0, atol=1e-6)
    for cut, whole in zip(grads_cut, grads_all):
        torch.testing.assert_close(cut, whole, rtol=0, atol=1e-6)
    with torch.no_grad():  # the old-policy pass: no entropy at all
        logp_only, none = module.sequence_log_probs(tiny_gpt, tokens, 0.9, first, Entropy.NONE)
    assert none is None
    torch.testing.assert_close(logp_only, logp_cut, rtol=0, atol=0)
