"""Trainer replicas on GPUs under torchft's NCCL groups: kill one mid-run; the survivor goes on, the killed
one heals back, and the final weights are within float tolerance of a fault-free run's."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import require_gpus
from tests.integration.erld_support import run_job
from tests.integration.test_replicas import assert_a_lossless_replica_kill, replica_job

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]

# GPU kernels are deterministic here but the quorum's shards change when a replica leaves: fp32 rounding.
TOLERANCE = 1e-4


@pytest.mark.parametrize("group", ["nccl", "baby_nccl"])
def test_killing_a_replica_under_nccl_loses_no_step(gpu_daemon, tmp_path, group):
    require_gpus(3)  # two trainer ranks and the cpu engine's slot
    job = replica_job(2) + ["--set", "engines.count=1", "--set", f"fault_tolerance.gpu_process_group={group}"]
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(gpu_daemon, clean, job, timeout_s=900)
    assert run_job(gpu_daemon, faulty, job, [("trainer-1-0", 2)], timeout_s=900) == ["trainer-1-0"]
    assert_a_lossless_replica_kill(clean, faulty, TOLERANCE)
