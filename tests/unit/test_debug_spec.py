"""Debug modes in the spec: which processes each runs, and the settings that cannot go together."""

from __future__ import annotations

import pytest

from daemon.plan import job_groups
from elastic_rl.errors import SpecError
from elastic_rl.spec.loading import validate_spec
from policies.placement import GroupKind

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def spec(tmp_path, **debug):
    return validate_spec({"name": "t", "fault_tolerance": {"warm_spares": 1}, "debug": debug}, base_dir=tmp_path)


def test_each_mode_starts_only_its_side(tmp_path):
    kinds = lambda job: sorted({group.kind.value for group in job_groups(job)})  # noqa: E731
    # Every kind but a distillation teacher's engines, which only algorithm.distillation.engines asks for.
    assert kinds(spec(tmp_path)) == sorted(kind.value for kind in GroupKind if kind is not GroupKind.TEACHER)
    only_rollouts = spec(tmp_path, rollout_only=True)
    assert kinds(only_rollouts) == ["engine", "services"] and only_rollouts.devices_needed == 2
    only_training = spec(tmp_path, train_only=".")
    assert kinds(only_training) == ["replica", "services", "spare"] and only_training.devices_needed == 2
    assert only_training.debug.train_only == tmp_path.resolve()


def test_modes_that_cannot_run_are_named(tmp_path):
    with pytest.raises(SpecError, match="set one of them"):
        spec(tmp_path, rollout_only=True, train_only=".")
    with pytest.raises(SpecError, match="debug.train_only: no folder"):
        spec(tmp_path, train_only="missing")
    (tmp_path / "held-out.jsonl").write_text('{"prompt": "1=", "label": "1"}\n')
    with pytest.raises(SpecError, match="debug.train_only starts none"):
        validate_spec(
            {
                "name": "t",
                "debug": {"train_only": "."},
                "eval": {"interval_rollouts": 1, "datasets": [{"name": "h", "path": "held-out.jsonl"}]},
            },
            base_dir=tmp_path,
        )
