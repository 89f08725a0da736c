"""Next-token choice: greedy, truncation, seeds, and the log probability reported."""

from __future__ import annotations

import math

import pytest
import torch

from elastic_rl.engines.sampling import InvalidRequest, SamplingParams, choose_next_token

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])


def test_greedy_takes_the_argmax_with_its_raw_logprob():
    token, logprob = choose_next_token(LOGITS, SamplingParams(temperature=0), torch.Generator())
    assert token == 0
    assert logprob == pytest.approx(float(LOGITS.log_softmax(-1)[0]))


def test_logprob_is_under_the_temperature_scaled_distribution():
    params = SamplingParams(temperature=0.5, seed=1)
    token, logprob = choose_next_token(LOGITS, params, torch.Generator().manual_seed(1))
    assert logprob == pytest.approx(float((LOGITS / 0.5).log_softmax(-1)[token]))


def test_top_k_one_is_greedy():
    for seed in range(20):
        token, _ = choose_next_token(LOGITS, SamplingParams(top_k=1), torch.Generator().manual_seed(seed))
        assert token == 0


def test_top_p_keeps_only_the_nucleus():
    probs = LOGITS.softmax(-1)
    top_p = float(probs[0] + probs[1]) - 1e-3  # tokens 0 and 1 are needed to reach it
    seen = {
        choose_next_token(LOGITS, SamplingParams(top_p=top_p), torch.Generator().manual_seed(seed))[0]
        for seed in range(200)
    }
    assert seen == {0, 1}


def test_same_seed_same_choice():
    params = SamplingParams(temperature=1.0)
    draws = [
        [choose_next_token(LOGITS, params, generator)[0] for _ in range(10)]
        for generator in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))
    ]
    assert draws[0] == draws[1]


def test_from_json_accepts_sglang_names():
    params = SamplingParams.from_json({"max_new_tokens": 3, "sampling_seed": 9, "stop_token_ids": [2]})
    assert params.seed == 9 and params.stop_token_ids == (2,)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": -5}, "max_new_tokens"),
        ({"max_new_tokenz": 5}, "unknown key"),
    ],
)
def test_bad_params_name_the_field(bad, field):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams.from_json(bad)


def test_logprobs_are_normalised():
    total = sum(math.exp(float(v)) for v in (LOGITS / 0.7).log_softmax(-1))
    assert total == pytest.approx(1.0)
