"""The commit protocol, discovery, retention and rewind, on work dirs made by hand."""

from __future__ import annotations

import orjson
import pytest

from checkpoints import layout
from checkpoints.discovery import (
    newest_valid_snapshot,
    snapshot_path,
    snapshots_to_delete,
    valid_steps,
    weights_to_delete,
)
from checkpoints.manifest import verify, write_manifest
from checkpoints.retention import apply_retention, prune_weights
from checkpoints.rewind import rewind
from elastic_rl.errors import ElasticRLError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def make_snapshot(workdir, step, last_rollout, commit=True):
    path = snapshot_path(workdir, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes([step % 256]) * 100)
    if commit:
        write_manifest(path, {"step": step, "last_rollout": last_rollout})
    return path


def make_rollout(workdir, rollout_id):
    folder = layout.rollout_dir(workdir, rollout_id)
    folder.mkdir(parents=True)
    (folder / layout.META_FILE).write_text("{}")


def test_manifest_catches_every_kind_of_damage(tmp_path):
    path = make_snapshot(tmp_path, 10, 4)
    assert verify(path) is None
    data = path / "__0_0.distcp"
    data.write_bytes(b"\x00" + data.read_bytes()[1:])
    assert "checksum" in verify(path)
    data.write_bytes(b"short")
    assert "bytes" in verify(path)
    data.unlink()
    assert "missing" in verify(path)
    assert "manifest" in verify(make_snapshot(tmp_path, 12, 5, commit=False))


def test_newest_valid_skips_uncommitted_and_reports_it(tmp_path):
    make_snapshot(tmp_path, 10, 4)
    make_snapshot(tmp_path, 20, 9, commit=False)  # killed mid-save
    skipped = []
    info = newest_valid_snapshot(tmp_path, on_invalid=lambda path, why: skipped.append(path.name))
    assert (info.step, info.last_rollout) == (10, 4)
    assert skipped == [snapshot_path(tmp_path, 20).name]
    assert newest_valid_snapshot(tmp_path / "empty") is None


def test_retention_keeps_last_k_and_every_nth():
    assert snapshots_to_delete([2, 4, 6, 8, 10, 12], keep_last=2, keep_every=0) == [2, 4, 6, 8]
    assert snapshots_to_delete([2, 4, 6, 8, 10, 12], keep_last=2, keep_every=4) == [2, 6]


def test_retention_truncates_the_log_below_the_oldest_kept_snapshot(tmp_path):
    for step, rollout in ((2, 0), (4, 1), (6, 2), (8, 3)):
        make_snapshot(tmp_path, step, rollout)
    for rollout in range(5):
        make_rollout(tmp_path, rollout)
    assert apply_retention(tmp_path, keep_last=2, keep_every=0) == [2, 4]
    assert valid_steps(tmp_path) == [6, 8]
    # The oldest kept snapshot applied rollout 2; the log keeps 2 and what follows.
    assert layout.committed_rollouts(tmp_path) == [2, 3, 4]


def test_rewind_moves_newer_state_aside(tmp_path):
    for step, rollout in ((2, 0), (4, 1), (6, 2)):
        make_snapshot(tmp_path, step, rollout)
    for rollout in range(4):
        make_rollout(tmp_path, rollout)
        layout.weights_dir(tmp_path, rollout + 1).mkdir(parents=True)
        layout.train_metrics_path(tmp_path, rollout).parent.mkdir(exist_ok=True)
        layout.train_metrics_path(tmp_path, rollout).write_text("{}")
    (tmp_path / "metrics.jsonl").write_bytes(b"".join(orjson.dumps({"rollout": r}) + b"\n" for r in range(4)))

    assert rewind(tmp_path, 4) == 1
    assert valid_steps(tmp_path) == [2, 4]
    assert layout.committed_rollouts(tmp_path) == [0, 1]
    assert layout.latest_weights_version(tmp_path) == 2
    assert [orjson.loads(line)["rollout"] for line in (tmp_path / "metrics.jsonl").read_bytes().splitlines()] == [0, 1]
    aside = next((tmp_path / "rewound").iterdir())
    assert (aside / "rollouts" / "000003").is_dir() and (aside / "snapshots").is_dir()


def test_rewind_to_a_bad_snapshot_names_the_valid_ones(tmp_path):
    make_snapshot(tmp_path, 2, 0)
    with pytest.raises(ElasticRLError, match="valid snapshots: 2"):
        rewind(tmp_path, 3)


def test_metadata_with_a_foreign_global_is_refused(tmp_path):
    import os
    import pickle

    from checkpoints.safe_reader import SafeFileSystemReader

    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="never holds"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_weights_retention_keeps_the_newest_the_snapshots_and_the_recently_superseded():
    exported = {version: 100.0 + 10 * version for version in range(6)}  # version v at 100 + 10 v
    assert weights_to_delete([0, 1, 2, 3, 4, 5], 2, {2}, exported, now=1000, grace_s=60) == [0, 1, 3]
    assert weights_to_delete([3, 4], 2, set(), exported, now=1000, grace_s=60) == []
    # At 175 s versions 0..3 were superseded 65, 55, 45, 35 s ago: only 0 is past a 60 s grace.
    assert weights_to_delete([0, 1, 2, 3, 4, 5], 2, set(), exported, now=175, grace_s=60) == [0]


def test_pruning_weights_deletes_their_folders(tmp_path):
    for version in range(4):
        layout.weights_dir(tmp_path, version).mkdir(parents=True)
    assert prune_weights(tmp_path, keep_last=2, grace_s=0) == [0, 1]
    assert layout.weights_versions(tmp_path) == [2, 3]
