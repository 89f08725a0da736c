"""Rollout routing replay: the cpu engine's routing records against the trainer's routers, in two
pipeline stages, on a mixture of experts with no near tie and on one built with near ties (two experts
whose router rows differ by 1e-8), where the engine and the trainer route some tokens differently;
the gradient of a replayed step under full recomputation; and a rollout's routing committed to the
rollout log and read back, as a trainer replaying the log after a crash reads it."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.integration.test_moe import EXPERTS, moe_checkpoint
from tests.processes import run_module_ranks

pytestmark = [pytest.mark.integration]

QWEN3_MOE = {"head_dim": 16, "num_experts": EXPERTS, "moe_intermediate_size": 64, "norm_topk_prob": True}
TIE = 1e-8
"""How far apart the near-tied experts' router rows are: below the engine's and the trainer's rounding
differences, so some tokens' choice between the two comes down to rounding."""


def near_tie_checkpoint(base: Path, folder: Path) -> Path:
    """``base`` with expert 1's router row in every layer set to expert 0's plus noise of size ``TIE``: the
    two score within rounding of each other, and one of them is a token's second choice a third of the time."""
    shutil.copytree(base, folder)
    state = load_file(str(folder / "model.safetensors"))
    noise = torch.Generator().manual_seed(1)
    for name, weight in state.items():
        if name.endswith("mlp.gate.weight"):
            weight[1] = weight[0] + TIE * torch.randn(weight.shape[1], generator=noise)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.timeout(120)
def test_replayed_routing_closes_the_log_prob_gap_that_near_ties_open(tmp_path):
    plain = moe_checkpoint(tmp_path / "plain", **QWEN3_MOE)
    tied = near_tie_checkpoint(plain, tmp_path / "tied")
    out = tmp_path / "out"
    out.mkdir()
    run_module_ranks("tests.integration.routing_replay_worker", 2, out, 2, plain, tied)
    plain_result = orjson.loads((out / "plain.json").read_bytes())
    tied_result = orjson.loads((out / "tied.json").read_bytes())

    # No near tie: the engine's record is what the trainer's routers choose themselves.
    assert plain_result["agreement"] == 1.0, plain_result
    assert plain_result["gap_own"] <= 1e-5 and plain_result["gap_replayed"] <= 1e-5, plain_result
    # Near ties: routed alike only by replay, and the log probs with it.
    assert tied_result["agreement"] < 0.99, tied_result
    assert tied_result["gap_own"] > 1e-3, tied_result
    assert tied_result["gap_replayed"] <= 1e-5 and tied_result["gap_replayed_packed"] <= 1e-5, tied_result
    # A forward recomputed in the backward pass replays its own micro-batch's routing too.
    assert tied_result["recompute_gradient_gap"] <= 1e-6, tied_result
    # The routing committed with a rollout and read back trains exactly what the engine's did, and it
    # matters: without it the trainer's own routing trains other weights.
    assert tied_result["log_vs_memory"] == 0.0, tied_result
    assert tied_result["unrouted_vs_memory"] > 1e-4, tied_result
