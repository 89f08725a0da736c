"""Data-parallel ranks inside a replica (DP=2, at TP=1 and, under `make chaos`, TP=2): the sharded
optimizer updates the weights the whole one does, DP=2 trains what DP=1 does, and a snapshot of the
sharded state loads into a DP=1 replica."""

from __future__ import annotations

import orjson
import pytest

from tests.processes import run_module_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]


@pytest.mark.parametrize("tensor_parallel", [1, pytest.param(2, marks=pytest.mark.chaos)])
def test_a_sharded_optimizer_trains_as_a_whole_one_and_its_snapshot_reshards(tmp_path, tensor_parallel):
    ranks = 2 * tensor_parallel
    run_module_ranks("tests.integration.data_parallel_worker", ranks, tmp_path, tensor_parallel)
    for rank in range(ranks):
        check(orjson.loads((tmp_path / f"result.{rank}.json").read_bytes()))


def check(result: dict) -> None:
    """One rank's differences, each relative to its tensor's largest entry."""
    assert result["sharded_vs_whole"] <= 1e-6, result
    # Each rank sums its half of the batch, then the two halves are summed: another order of the same sums.
    assert result["dp2_vs_dp1"] <= 1e-5, result
    assert 0 < result["owned_states"] < result["all_states"], result  # each rank holds only its share
    assert result["loaded_weights_vs_whole"] == 0.0 and result["loaded_moments_vs_whole"] == 0.0, result
    assert result["resumed_step_vs_whole"] <= 1e-6, result
