"""`erl chaos run` on one short scenario of the library, as `make test` runs it; scenario errors."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from checkpoints.layout import read_lines
from tests.integration.erld_support import erl
from tests.processes import REPO

pytestmark = [pytest.mark.integration]

SCENARIOS = REPO / "chaos" / "scenarios"


@pytest.mark.timeout(600)
def test_the_engine_hang_scenario_passes_with_its_report(tmp_path):
    out = tmp_path / "report"
    ran = erl(
        "chaos",
        "run",
        str(SCENARIOS / "engine-hang.yaml"),
        "--out",
        str(out),
        "--cache",
        str(tmp_path / "cache"),
        timeout=580,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["passed"] and all(check["held"] for check in report["invariants"])
    assert len(report["invariants"]) == 11
    (fault,) = report["faults"]
    assert fault["kind"] == "hang" and fault["target"] == "engine-0" and fault["samples_lost"] == 0
    assert fault["detection_s"] > 0  # measured; how long it took is the report's, not a pass/fail bound
    assert 0 < report["ettr"] <= 1.2
    assert (out / "report.md").read_text().startswith("# Chaos scenario `engine-hang`: PASSED")
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    # The only engine hung: found by the health check, replaced once, and the replacement served.
    events = read_lines(Path(report["workdir"]) / "events.jsonl")
    kinds = Counter(e["kind"] for e in events if e.get("proc") == "engine-0")
    assert kinds["engine_unhealthy"] == 1 and kinds["proc_restarted"] == 1 and kinds["engine_serving"] == 1, kinds


@pytest.mark.timeout(60)
def test_a_bad_scenario_is_named_and_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\njob: ../nowhere.yaml\nfaults:\n  - {kind: explode, at: {rollout: 1}}\n")
    ran = erl("chaos", "run", str(bad))
    assert ran.returncode == 2 and "faults.0.kind" in ran.stderr
    bad.write_text(
        f"name: bad\njob: {REPO / 'examples' / 'tiny-grpo.yaml'}\n"
        "faults:\n  - {kind: kill_node, at: {rollout: 1}}\n"
    )
    ran = erl("chaos", "run", str(bad))
    assert ran.returncode == 2 and "kill_node needs topology.nodes >= 2" in ran.stderr
