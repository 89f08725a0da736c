"""Micro-batches by token budget give the gradient of one big batch, for every loss aggregation."""

from __future__ import annotations

import orjson
import pytest

from tests.processes import run_module_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]


def test_the_gradient_does_not_depend_on_the_micro_batches(tmp_path):
    out = tmp_path / "result.json"
    run_module_ranks("tests.integration.micro_batch_worker", 1, out)
    differences = orjson.loads(out.read_bytes())
    assert len(differences) == 9
    for grouping, relative in differences.items():
        assert relative <= 1e-5, (grouping, relative)
