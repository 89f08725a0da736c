"""Rewinds a job's work dir to a chosen snapshot, for `erl resume --snapshot STEP`.

Everything newer than the snapshot (later snapshots, rollouts after the one it
applied, weights and metrics past it) is moved into ``rewound/<time>/`` rather
than deleted, so nothing is lost; the job then resumes from that snapshot.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import orjson

from checkpoints import layout
from checkpoints.discovery import valid_steps
from checkpoints.manifest import read_manifest, verify
from elastic_rl.errors import ElasticRLError


def rewind(workdir: Path, step: int) -> int:
    """Move everything after snapshot ``step`` aside; return the snapshot's last rollout."""
    path = layout.snapshot_path(workdir, step)
    problem = verify(path) if path.exists() else "it does not exist"
    if problem is not None:
        valid = ", ".join(map(str, valid_steps(workdir))) or "none"
        raise ElasticRLError(f"cannot resume from snapshot {step}: {problem}; valid snapshots: {valid}")
    last_rollout = int(read_manifest(path)["last_rollout"])
    aside = layout.rewound_dir(workdir, time.strftime("%Y%m%d-%H%M%S"))

    def move(item: Path) -> None:
        target = aside / item.relative_to(workdir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(item), str(target))

    for item in sorted(layout.snapshot_root(workdir).iterdir()):
        if item.name.isdigit() and int(item.name) > step:
            move(item)
    for rollout_id in layout.committed_rollouts(workdir):
        if rollout_id > last_rollout:
            move(layout.rollout_dir(workdir, rollout_id))
    weights = layout.weights_root(workdir)
    for item in sorted(weights.iterdir()) if weights.is_dir() else []:
        if item.name.isdigit() and int(item.name) > layout.version_after(last_rollout):
            move(item)
    for rollout_id in range(last_rollout + 1, last_rollout + 1 + 10**6):
        metrics = layout.train_metrics_path(workdir, rollout_id)
        if not metrics.exists():
            break
        move(metrics)
    lines_file = layout.metrics_lines_path(workdir)
    if lines_file.exists():
        lines = lines_file.read_bytes().splitlines()
        keep = [line for line in lines if orjson.loads(line)["rollout"] <= last_rollout]
        lines_file.write_bytes(b"".join(line + b"\n" for line in keep))
    return last_rollout
