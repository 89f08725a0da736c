"""The demo's work dir: its weights and logs where checkpoints.layout puts a job's, in a folder of its
own beside the job's work dir. The export is a fake that records where it writes."""

from __future__ import annotations

import pytest

from checkpoints import layout
from elastic_rl import demo
from elastic_rl.spec.loading import validate_spec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_the_demo_exports_its_weights_where_the_layout_says(tmp_path, monkeypatch):
    written = []

    def fake_export(spec, folder):
        written.append(folder)
        return 0

    monkeypatch.setattr(demo, "export_initial_checkpoint", fake_export)
    spec = validate_spec({"name": "t"})
    assert demo.export_two_versions(spec, tmp_path) == (
        layout.weights_dir(tmp_path, 0),
        layout.weights_dir(tmp_path, 1),
    )
    assert written == [layout.weights_dir(tmp_path, 0), layout.weights_dir(tmp_path, 1)]
