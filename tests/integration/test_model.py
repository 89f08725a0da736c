"""The megatron model on CPU at TP=1 and TP=2: it trains, and its HF export has the same logits."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
import torch
from transformers import LlamaForCausalLM

from tests.processes import run_module_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def run_ranks(tp: int, out: Path) -> dict:
    """Run the megatron worker at TP=tp; return rank 0's results."""
    run_module_ranks("tests.integration.megatron_worker", tp, out)
    return orjson.loads((out / "result.json").read_bytes())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[Path, dict]]:
    """TP size -> (output folder, results) for the same seed and data at TP=1 and TP=2."""
    results = {}
    for tp in (1, 2):
        out = tmp_path_factory.mktemp(f"tp{tp}")
        results[tp] = out, run_ranks(tp, out)
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_export_has_the_same_logits(runs, tp):
    out, _ = runs[tp]
    saved = torch.load(out / "logits.pt", weights_only=True)
    hf = LlamaForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(saved["tokens"]).logits
    assert hf_logits.shape == saved["logits"].shape
    assert (hf_logits - saved["logits"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tp", [1, 2])
def test_model_trains(runs, tp):
    _, result = runs[tp]
    losses = result["losses"]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.5 * losses[0]
    assert all(0 <= value <= math.log(64) + 1e-4 for value in result["entropies"])


def test_tp2_matches_tp1(runs):
    """Same seed, same data: the two tensor-parallel sizes follow the same loss curve."""
    for one, two in zip(runs[1][1]["losses"], runs[2][1]["losses"]):
        assert two == pytest.approx(one, rel=1e-4, abs=1e-5)
