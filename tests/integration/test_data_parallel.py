"""Data-parallel ranks inside a replica: the sharded optimizer updates the weights the whole one does,
DP=2 trains what DP=1 does, and a snapshot of the sharded state loads into a DP=1 replica."""

from __future__ import annotations

import orjson
import pytest

from tests.processes import run_module_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]


def test_a_sharded_optimizer_trains_as_a_whole_one_and_its_snapshot_reshards(tmp_path):
    run_module_ranks("tests.integration.data_parallel_worker", 2, tmp_path)
    result = orjson.loads((tmp_path / "result.json").read_bytes())
    assert result["sharded_vs_whole"] <= 1e-6, result
    # Each rank sums its half of the batch, then the two halves are summed: another order of the same sums.
    assert result["dp2_vs_dp1"] <= 1e-5, result
    assert 0 < result["owned_states"] < result["all_states"], result  # rank 0 holds only its share
    assert result["loaded_weights_vs_whole"] == 0.0 and result["loaded_moments_vs_whole"] == 0.0, result
    assert result["resumed_step_vs_whole"] <= 1e-6, result
