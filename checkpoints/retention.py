"""Applies retention after a snapshot commits: old snapshots go, and so does the rollout log below them.

Only rank 0 of the exporting replica calls this. The rollout log is cut below
the oldest snapshot kept: every rollout a resume could need to replay stays.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from checkpoints.discovery import snapshot_path, snapshots_to_delete, valid_steps
from checkpoints.manifest import read_manifest
from elastic_rl import jobenv


def apply_retention(workdir: Path, keep_last: int, keep_every: int) -> list[int]:
    """Delete the snapshots retention drops and the rollouts no kept snapshot needs; return the deleted steps."""
    steps = valid_steps(workdir)
    doomed = snapshots_to_delete(steps, keep_last, keep_every)
    for step in doomed:
        shutil.rmtree(snapshot_path(workdir, step), ignore_errors=True)
    kept = [step for step in steps if step not in doomed]
    if kept:
        oldest_needed = int(read_manifest(snapshot_path(workdir, min(kept)))["last_rollout"])
        for rollout_id in jobenv.committed_rollouts(workdir):
            if rollout_id < oldest_needed:
                shutil.rmtree(jobenv.rollout_dir(workdir, rollout_id), ignore_errors=True)
    return doomed
