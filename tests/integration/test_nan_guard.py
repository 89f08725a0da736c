"""The NaN/Inf guard with real trainer replicas under erld: a transient fault, bad data, a bad device."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from elastic_rl import jobenv
from tests.integration.erld_support import job_events, metrics, run_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

ROLLOUTS = 4
NAN_STEP = 5  # rollout 2's second optimizer step (512 samples a rollout, 256 a step)


def nan_job(*injection: str) -> list[str]:
    args = [
        "--set", f"rollout.num_rollouts={ROLLOUTS}",
        "--set", "trainer.replicas=2",
        "--set", "checkpoints.keep_last=1000",
        "--set", "fault_tolerance.quorum_timeout_s=20",
        "--set", f"fault_tolerance.inject_nan.steps=[{NAN_STEP}]",
    ]  # fmt: skip
    for setting in injection:
        args += ["--set", f"fault_tolerance.{setting}"]
    return args


def assert_run_completed(workdir) -> None:
    assert [line["rollout"] for line in metrics(workdir)] == list(range(ROLLOUTS))
    weights = load_file(str(jobenv.weights_dir(workdir, ROLLOUTS) / "model.safetensors"))
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())


def test_a_transient_nan_is_skipped_without_a_rollback(daemon, tmp_path):
    run_job(daemon, tmp_path, nan_job("inject_nan.replica=0", "inject_nan.attempts=1"))
    assert_run_completed(tmp_path)
    kinds = Counter(e["kind"] for e in job_events(tmp_path))
    assert kinds["nan_step_skipped"] == 1, kinds
    assert not kinds["trainer_rollback"] and not kinds["rollout_quarantined"] and not kinds["device_quarantined"]
    assert jobenv.quarantined_rollouts(tmp_path) == set()


def test_nan_in_the_data_quarantines_the_batch_and_rolls_back(daemon, tmp_path):
    run_job(daemon, tmp_path, nan_job("max_consecutive_nan_skips=2"))
    assert_run_completed(tmp_path)
    events = job_events(tmp_path)
    kinds = Counter(e["kind"] for e in events)
    assert kinds["nan_step_skipped"] == 1 and kinds["rollout_quarantined"] == 1, kinds
    assert kinds["trainer_rollback"] == 2, kinds  # both replicas restarted from the newest snapshot
    quarantined = NAN_STEP // 2
    assert jobenv.quarantined_rollouts(tmp_path) == {quarantined}
    assert metrics(tmp_path)[quarantined]["train/quarantined"] == 1.0
    assert not kinds["device_quarantined"]


def test_nan_on_one_replica_quarantines_its_device(daemon, tmp_path):
    run_job(daemon, tmp_path, nan_job("inject_nan.replica=1"))
    assert_run_completed(tmp_path)
    events = job_events(tmp_path)
    kinds = Counter(e["kind"] for e in events)
    quarantined = [e for e in events if e["kind"] == "device_quarantined"]
    assert [e["proc"] for e in quarantined] == ["trainer-1-0"]
    assert quarantined[0]["step"] == NAN_STEP and quarantined[0]["device"] is not None
    # The replica moved to a free device (the test daemon has spare slots), or the job ran on without it.
    assert kinds["replica_moved"] + kinds["replica_degraded"] == 1, kinds
    assert not kinds["trainer_rollback"] and not kinds["rollout_quarantined"]
