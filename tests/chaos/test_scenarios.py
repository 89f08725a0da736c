"""`make chaos`: every scenario of the library passes, with its report."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.harness import run_scenario
from chaos.scenario import load_scenario
from tests.processes import REPO

LIBRARY = sorted((REPO / "chaos" / "scenarios").glob("*.yaml"))


@pytest.mark.chaos
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", LIBRARY, ids=[p.stem for p in LIBRARY])
def test_scenario_passes(path: Path, tmp_path_factory):
    out = tmp_path_factory.mktemp(path.stem)
    result = run_scenario(load_scenario(path), out, REPO / "runs" / ".chaos-cache")
    assert result.passed, (result.error, [c for c in result.checks if not c.held], out / "report.md")
