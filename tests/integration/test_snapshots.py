"""DCP snapshots round-trip across tensor-parallel sizes, bitwise where the topology is kept."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from checkpoints.discovery import newest_valid_snapshot
from checkpoints.layout import snapshot_path
from tests.integration.test_model import run_module_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def weights(workdir, name):
    return torch.load(workdir / f"{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def saved_at_tp2(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("snap")
    run_module_ranks("tests.integration.snapshot_worker", 2, "save", workdir)
    return workdir


def test_snapshot_is_committed_with_a_manifest(saved_at_tp2):
    info = newest_valid_snapshot(saved_at_tp2)
    assert info is not None and info.step == 3 and info.last_rollout == 7
    assert (info.path / "manifest.json").is_file()


@pytest.mark.parametrize(("tp", "mode"), [(2, "load"), (1, "load"), (2, "load-offloaded")])
def test_resume_at_any_tp_restores_the_weights_and_continues(saved_at_tp2, tmp_path, tp, mode):
    """At TP=2 and 1, and with the optimizer's state loaded into host memory (trainer.optimizer_offload): the
    policy and PPO's critic beside it (``critic.``), each with its AdamW state and schedule."""
    workdir = tmp_path / "w"
    shutil.copytree(saved_at_tp2, workdir)
    run_module_ranks("tests.integration.snapshot_worker", tp, mode, workdir)
    saved, loaded = weights(saved_at_tp2, "save-tp2"), weights(workdir, f"{mode}-tp{tp}")
    assert any(name.startswith("critic.value_head.") for name in saved["final"])
    for name, tensor in saved["snapshot"].items():
        assert torch.equal(loaded["snapshot"][name], tensor), name
    for name, tensor in saved["final"].items():
        if tp == 2:  # same topology: bitwise
            assert torch.equal(loaded["final"][name], tensor), name
        else:  # resharded: same maths, other summation order
            torch.testing.assert_close(loaded["final"][name], tensor, rtol=1e-4, atol=1e-6)


def test_corrupt_snapshot_is_skipped_for_the_previous_one(saved_at_tp2, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(saved_at_tp2, workdir)
    newer = snapshot_path(workdir, 4)
    shutil.copytree(snapshot_path(workdir, 3), newer)
    (newer / "manifest.json").write_text((newer / "manifest.json").read_text().replace('"step":3', '"step":4'))
    data_file = next(p for p in newer.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    skipped = []
    info = newest_valid_snapshot(workdir, on_invalid=lambda path, why: skipped.append((path.name, why)))
    assert info.step == 3
    assert skipped and skipped[0][0] == newer.name and "checksum" in skipped[0][1]


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs: room for one snapshot of the test model (about 1 MB), not two."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_full_disk_fails_that_save_and_training_goes_on(small_disk, tmp_path):
    workdir = small_disk / "w"
    workdir.mkdir()
    result_file = tmp_path / "result.json"
    run_module_ranks("tests.integration.snapshot_worker", 2, "full-disk", workdir, result_file)
    result = json.loads(result_file.read_text())
    assert [step for step, _ in result["failed"]] == [2], result
    # ENOSPC surfaces as OSError 28, or, when it strikes inside torch's zip writer, as a
    # DCP write failure ("unexpected pos"): both are this save's disk filling up.
    error = result["failed"][0][1]
    assert "No space left on device" in error or error.startswith("CheckpointException('write'"), error
    # The failed save left no snapshot that counts; the next one committed.
    assert result["newest"] == 3
    assert newest_valid_snapshot(workdir).step == 3
