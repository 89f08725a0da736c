"""Applies retention: old snapshots go, and with them the rollout log below them; old weights go.

Only rank 0 of the exporting replica calls these. The rollout log is cut below
the oldest snapshot kept: every rollout a resume could need to replay stays.
Exported weights are kept for the newest versions (what engines load, and a
replacement engine starts on) and for every kept snapshot (what engines start
on after `erl resume --snapshot` rewinds to it).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from checkpoints import layout
from checkpoints.discovery import snapshots_to_delete, valid_steps, weights_to_delete
from checkpoints.manifest import read_manifest
from checkpoints.rollout_log import cut_below


def apply_retention(workdir: Path, keep_last: int, keep_every: int) -> list[int]:
    """Delete the snapshots retention drops and the rollouts no kept snapshot needs; return the deleted steps."""
    steps = valid_steps(workdir)
    doomed = snapshots_to_delete(steps, keep_last, keep_every)
    for step in doomed:
        shutil.rmtree(layout.snapshot_path(workdir, step), ignore_errors=True)
    kept = [step for step in steps if step not in doomed]
    if kept:
        cut_below(workdir, int(read_manifest(layout.snapshot_path(workdir, min(kept)))["last_rollout"]))
    return doomed


def prune_weights(workdir: Path, keep_last: int, grace_s: float) -> list[int]:
    """Delete the exported weight versions nobody needs any more; return them. ``grace_s``: how long
    an engine may take to start (and load the version it was started on)."""
    needed = set()
    for step in valid_steps(workdir):
        manifest = read_manifest(layout.snapshot_path(workdir, step))
        if manifest is not None:  # else snapshot retention deleted it since it was verified
            needed.add(layout.version_after(int(manifest["last_rollout"])))
    versions = layout.weights_versions(workdir)
    exported_at = {v: layout.weights_dir(workdir, v).stat().st_mtime for v in versions}
    doomed = weights_to_delete(versions, keep_last, needed, exported_at, time.time(), grace_s)
    for version in doomed:
        shutil.rmtree(layout.weights_dir(workdir, version), ignore_errors=True)
    return doomed
