"""The NaN/Inf guard with real trainer replicas under erld, through the chaos harness's `nan` fault:
a transient fault, bad data, a bad device (in the policy's loss, and in PPO's value loss). Each
scenario's invariants hold; the guard's decisions are its events."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from chaos.harness import run_scenario
from chaos.scenario import load_scenario
from checkpoints import layout
from checkpoints.layout import read_lines
from tests.integration.erld_support import NO_POOL
from tests.processes import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

NAN_STEP = 5  # rollout 2's second optimizer step (512 samples a rollout, 256 a step)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The three scenarios share their job, so one fault-free reference serves them all."""
    return tmp_path_factory.mktemp("reference")


def run(name: str, out: Path, cache: Path) -> tuple[Path, Counter, list[dict]]:
    scenario = load_scenario(REPO / "chaos" / "scenarios" / f"{name}.yaml")
    # No pre-imported interpreters: on 2 cores they slowed the device case by 6 s (58 s against 52 s), even
    # importing at the lowest priority.
    scenario = scenario.model_copy(update={"topology": scenario.topology.model_copy(update={"pool": NO_POOL})})
    result = run_scenario(scenario, out, cache)
    assert result.passed, [check for check in result.checks if not check.held] or result.error
    workdir = out / "faulty" / "job"
    events = read_lines(workdir / "events.jsonl")
    return workdir, Counter(e["kind"] for e in events), events


@pytest.mark.chaos  # `make chaos`: the nan-transient scenario; make test keeps the device case
def test_a_transient_nan_is_skipped_without_a_rollback(tmp_path, cache):
    workdir, kinds, _ = run("nan-transient", tmp_path, cache)
    assert kinds["nan_step_skipped"] == 1, kinds
    assert not kinds["trainer_rollback"] and not kinds["rollout_quarantined"] and not kinds["device_quarantined"]
    assert layout.quarantined_rollouts(workdir) == set()


@pytest.mark.chaos  # `make chaos`, to keep `make test` within its time: the rollback path
def test_nan_in_the_data_quarantines_the_batch_and_rolls_back(tmp_path, cache):
    workdir, kinds, _ = run("nan-data", tmp_path, cache)
    assert kinds["nan_step_skipped"] == 2 and kinds["rollout_quarantined"] == 1, kinds
    assert kinds["trainer_rollback"] == 2, kinds  # both replicas restarted from the newest snapshot
    quarantined = NAN_STEP // 2
    assert layout.quarantined_rollouts(workdir) == {quarantined}
    assert read_lines(workdir / "metrics.jsonl")[quarantined]["train/quarantined"] == 1.0
    assert not kinds["device_quarantined"]


def test_nan_on_one_replica_quarantines_its_device(tmp_path, cache):
    check_the_device_quarantined(*run("nan-replica", tmp_path, cache)[1:])


@pytest.mark.chaos  # `make chaos`: make test keeps the policy's case (above)
def test_nan_in_one_replicas_value_loss_quarantines_its_device(tmp_path, cache):
    """PPO: the guard covers the critic's value loss as it covers the policy's loss."""
    check_the_device_quarantined(*run("nan-critic", tmp_path, cache)[1:])


def check_the_device_quarantined(kinds: Counter, events: list[dict]) -> None:
    quarantined = [e for e in events if e["kind"] == "device_quarantined"]
    assert [e["proc"] for e in quarantined] == ["trainer-1-0"]
    assert quarantined[0]["step"] == NAN_STEP and quarantined[0]["device"] is not None
    # The replica moved to a free device (the test erld has spare slots), or the job ran on without it.
    assert kinds["replica_moved"] + kinds["replica_degraded"] == 1, kinds
    assert not kinds["trainer_rollback"] and not kinds["rollout_quarantined"]
