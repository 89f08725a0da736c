"""Pretrained models trained at TP=2 as at TP=1: a Qwen3 (per-head q/k norms: each rank applies them to its
own heads, so their gradients are summed over the ranks), the same with sequence parallelism, and a
Qwen3-MoE, which trains at TP > 1 only with sequence parallelism, replaying a routing record. The
parameters every rank holds whole stay bitwise one."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.integration.test_moe import EXPERTS, moe_checkpoint
from tests.integration.test_pretrained import make_checkpoints
from tests.processes import SPEC, run_module_ranks

pytestmark = [pytest.mark.integration]

RUNS = {"qwen3": ("qwen3", False), "qwen3-sp": ("qwen3", True), "qwen3-moe-sp": ("qwen3-moe", True)}
"""Run name: (model, trainer.sequence_parallel at TP=2). The mixture of experts replays a routing record:
under sequence parallelism each rank's routers replay their slice of the sequence."""


@pytest.mark.timeout(240)
def test_pretrained_models_train_at_tp2_as_at_tp1_and_the_ranks_hold_one_model(tmp_path):
    models = {"qwen3": make_checkpoints(tmp_path / "models", smollm2=False)["qwen3"]}
    qwen3_moe = {"head_dim": 16, "num_experts": EXPERTS, "moe_intermediate_size": 64, "norm_topk_prob": True}
    models["qwen3-moe"] = moe_checkpoint(tmp_path / "models" / "qwen3-moe-small", **qwen3_moe)
    runs = []
    for run, (model, sequence_parallel) in RUNS.items():
        spec = yaml.safe_load(SPEC.read_text())
        spec["model"] = {"hf_checkpoint": str(models[model])}
        if model == "qwen3-moe":
            spec["algorithm"]["routing_replay"] = True
        (tmp_path / f"{run}.yaml").write_text(yaml.safe_dump(spec))
        runs.append(f"{run}:{tmp_path / f'{run}.yaml'}:{int(sequence_parallel)}")
    for tp in (1, 2):
        run_module_ranks("tests.integration.tensor_parallel_worker", tp, tmp_path / f"tp{tp}", *runs)

    for run in RUNS:
        rank0, rank1 = (torch.load(tmp_path / "tp2" / run / f"whole.{rank}.pt") for rank in (0, 1))
        for name in rank0:
            assert torch.equal(rank0[name], rank1[name]), (run, name)
        one, two = (torch.load(tmp_path / f"tp{tp}" / run / "weights.pt") for tp in (1, 2))
        assert one.keys() == two.keys()
        for name in one:
            # Another order of the same sums, magnified by AdamW's first steps at lr 0.01.
            gap = ((one[name] - two[name]).abs().max() / one[name].abs().max()).item()
            assert gap <= 1e-2, (run, name, gap)
    assert any(name.endswith("q_layernorm.weight") for name in rank0)
