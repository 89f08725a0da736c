"""Log probs from bf16 logits: the temperature is applied in fp32, so they match the fp32 path."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state

from elastic_rl.model import sequence_log_probs as module
from elastic_rl.net import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class FakeLogitsModel(torch.nn.Module):
    """Stands in for the GPT model: its forward pass returns the logits it was given."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # where the model lives: the CPU


@pytest.fixture
def single_rank_model_parallel():
    """Megatron's groups at tensor-parallel size 1, over a one-process gloo group in this process."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_bf16_logits_give_the_fp32_log_probs_of_the_same_values(single_rank_model_parallel, monkeypatch):
    monkeypatch.setattr(module, "forward_gpt", lambda model, tokens: model.logits)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 9), generator=generator)
    exact = (torch.randn(2, 8, 64, generator=generator) * 8).bfloat16()  # values bf16 holds exactly
    temperature = 0.7  # a quotient bf16 would round
    logp_bf16, ent_bf16 = module.sequence_log_probs(FakeLogitsModel(exact), tokens, temperature)
    logp_fp32, ent_fp32 = module.sequence_log_probs(FakeLogitsModel(exact.float()), tokens, temperature)
    assert logp_bf16.dtype == torch.float32 and ent_bf16.dtype == torch.float32
    torch.testing.assert_close(logp_bf16, logp_fp32, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_bf16, ent_fp32, rtol=0, atol=1e-6)
