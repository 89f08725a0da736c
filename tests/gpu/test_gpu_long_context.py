"""Long sequences on one GPU: an 8,192-token sequence of the Llama 3.2 1B shape trains a step with its
peak below `erl plan`'s estimate, and packed micro-batches give padded ones' step within bf16 tolerance."""

from __future__ import annotations

import orjson
import pytest

from tests.gpu.conftest import require_gpus
from tests.processes import run_module_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

# bf16 autocast: matrix products round to 8 bits of mantissa, in another order packed than padded.
BF16_VALUES, BF16_RELATIVE = 5e-2, 2e-2


def test_an_8k_sequence_of_a_1b_model_fits_its_plan_and_packing_holds_in_bf16(tmp_path):
    require_gpus(1)
    run_module_ranks("tests.gpu.long_context_worker", 1, tmp_path, gpus=True)
    # The figures stay in tmp_path/result.json (keep them with pytest's --basetemp).
    result = orjson.loads((tmp_path / "result.json").read_bytes())
    long = result["long"]
    assert long["finite"], long
    assert 0 < long["peak_growth_bytes"] <= long["planned_bytes"], long
    packing = result["packing"]
    assert packing["old_logp"] <= BF16_VALUES and packing["loss"] <= BF16_RELATIVE, packing
    assert packing["grads"] <= BF16_RELATIVE, packing
