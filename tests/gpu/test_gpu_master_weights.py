"""bf16 parameters with fp32 main weights (``trainer.dtype: bf16-params``: megatron's Float16Module,
DistributedDataParallel and DistributedOptimizer) on one GPU: training follows fp32's, and a snapshot and a
heal carry the main weights and moments exactly, a snapshot into an fp32 replica too; the NaN guard skips
a poisoned step and leaves nothing of it behind."""

from __future__ import annotations

import orjson
import pytest

from tests.gpu.conftest import require_gpus
from tests.processes import run_module_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_bf16_parameters_train_like_fp32_and_their_main_weights_survive_a_snapshot_and_a_heal(tmp_path):
    require_gpus(1)
    run_module_ranks("tests.gpu.master_weights_worker", 1, tmp_path, gpus=True)
    result = orjson.loads((tmp_path / "result.0.json").read_bytes())
    print(result)  # the measured gaps, for docs/gpu.md
    assert result["parameter_dtypes"] == ["torch.bfloat16"], result
    assert result["gradient_dtypes"] == result["main_dtypes"] == ["torch.float32"], result
    assert result["parameters_are_main_rounded"], result
    assert result["main_elements"] == result["parameter_elements"], result  # one rank holds every range
    # bf16's rounding moves each loss a little; three AdamW steps go the way fp32's go.
    for fp32, bf16 in zip(result["losses"]["fp32"], result["losses"]["bf16-params"], strict=True):
        assert abs(bf16 - fp32) <= 0.05 * abs(fp32) + 1e-3, result["losses"]
    assert result["update_cosine"] > 0.9, result
    assert 0.8 < result["update_norm_ratio"] < 1.25, result
    for exact in (
        "snapshot_weights_bitwise",
        "snapshot_moments_bitwise",
        "fp32_load_weights_bitwise",
        "fp32_load_moments_bitwise",
        "healed_weights_bitwise",
        "resumed_step_bitwise",
        "healed_step_bitwise",
        "parameters_after_resumed_step_bitwise",
        "nan_step_skipped",
        "nan_step_left_weights",
        "step_after_nan_bitwise",
    ):
        assert result[exact], (exact, result)
