"""Async rollouts with a staleness bound: rollout N generates with weights N - k while the trainers
catch up; a trainer kill changes neither the bound nor (in `make chaos`) the final weights."""

from __future__ import annotations

import pytest

from chaos.invariants import check_run, check_rollouts_applied_once, check_staleness, check_whole_batches, read_spec
from checkpoints import layout
from checkpoints.rollout_log import read_rollout
from tests.integration.erld_support import metrics, run_job, status

pytestmark = [pytest.mark.integration]

ROLLOUTS = 10


def async_job(staleness: int) -> list[str]:
    return [
        "--set", "rollout.mode=async",
        "--set", f"rollout.max_staleness={staleness}",
        "--set", f"rollout.num_rollouts={ROLLOUTS}",
        "--set", "rollout.prompts_per_rollout=16",
        "--set", "trainer.global_batch_size=128",
        "--set", "checkpoints.keep_last=1000",
    ]  # fmt: skip


def assert_generated_k_behind(workdir, staleness: int) -> None:
    for rollout_id in range(ROLLOUTS):
        batch, _ = read_rollout(workdir, rollout_id)
        assert set(batch.weight_versions.tolist()) == {max(0, rollout_id - staleness)}, rollout_id
    assert [line["rollout/weight_version"] for line in metrics(workdir)] == [
        float(max(0, r - staleness)) for r in range(ROLLOUTS)]  # fmt: skip


@pytest.mark.timeout(300)
def test_two_versions_behind_through_a_trainer_kill(daemon, tmp_path):
    assert run_job(daemon, tmp_path, async_job(2), [("trainer-0-0", 4)]) == ["trainer-0-0"]
    assert_generated_k_behind(tmp_path, 2)
    spec = read_spec(tmp_path)
    for check in (check_rollouts_applied_once(tmp_path, spec), check_whole_batches(tmp_path, spec),
                  check_staleness(tmp_path, spec)):  # fmt: skip
        assert check.held, check
    assert layout.weights_dir(tmp_path, ROLLOUTS).is_dir()


@pytest.mark.chaos  # `make chaos`: two runs each
@pytest.mark.timeout(600)
@pytest.mark.parametrize("staleness", [1, 2])
def test_a_trainer_kill_leaves_async_weights_bitwise_equal(daemon, tmp_path, staleness):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(daemon, clean, async_job(staleness))
    assert run_job(daemon, faulty, async_job(staleness), [("trainer-0-0", 4)]) == ["trainer-0-0"]
    assert_generated_k_behind(faulty, staleness)
    checks = check_run(faulty, clean, status(daemon, "tiny-grpo")["status"], tolerance=0.0)
    assert all(check.held for check in checks), [check for check in checks if not check.held]
