"""A pretrained Qwen3 (per-head q/k norms) trained at TP=2 as at TP=1: each rank applies the norms to its own
heads, so their gradients are summed over the ranks, and the copies every rank holds stay one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.test_pretrained import make_checkpoints
from tests.processes import SPEC, run_module_ranks

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(180)
def test_qwen3_trains_at_tp2_as_at_tp1_and_its_ranks_hold_one_model(tmp_path):
    checkpoint = make_checkpoints(tmp_path / "models", smollm2=False)["qwen3"]
    spec = yaml.safe_load(SPEC.read_text())
    spec["model"] = {"hf_checkpoint": str(checkpoint)}
    spec_path = tmp_path / "qwen3.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    for tp in (1, 2):
        (tmp_path / f"tp{tp}").mkdir()
        run_module_ranks("tests.integration.tensor_parallel_worker", tp, tmp_path / f"tp{tp}", spec_path)

    rank0, rank1 = (torch.load(tmp_path / "tp2" / f"whole.{rank}.pt") for rank in (0, 1))
    assert any(name.endswith("q_layernorm.weight") for name in rank0)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    one, two = (torch.load(Path(tmp_path / f"tp{tp}" / "weights.pt")) for tp in (1, 2))
    assert one.keys() == two.keys()
    for name in one:
        gap = ((one[name] - two[name]).abs().max() / one[name].abs().max()).item()
        assert gap <= 1e-2, (name, gap)
