"""Finding snapshots: the newest valid one, and which ones retention keeps.

Snapshots live in ``workdir/snapshots/<step>/`` (the step zero-padded). An
invalid one (see ``manifest.verify``) is reported to the caller and skipped,
so resume falls back to the one before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from checkpoints.layout import snapshot_path, snapshot_root
from checkpoints.manifest import read_manifest, verify


@dataclass(frozen=True)
class SnapshotInfo:
    step: int
    path: Path
    last_rollout: int


def _steps(workdir: Path) -> list[int]:
    root = snapshot_root(workdir)
    return sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True) if root.is_dir() else []


def newest_valid_snapshot(
    workdir: Path,
    on_invalid: Callable[[Path, str], None] = lambda path, reason: None,
    at_most_step: int | None = None,
) -> SnapshotInfo | None:
    """The newest snapshot that verifies; each invalid one met on the way is reported."""
    for step in _steps(workdir):
        if at_most_step is not None and step > at_most_step:
            continue
        path = snapshot_path(workdir, step)
        problem = verify(path)
        if problem is not None:
            on_invalid(path, problem)
            continue
        return SnapshotInfo(step=step, path=path, last_rollout=int(read_manifest(path)["last_rollout"]))
    return None


def snapshots_to_delete(steps: list[int], keep_last: int, keep_every: int) -> list[int]:
    """Retention: keep the newest ``keep_last``, and every step that is a multiple of ``keep_every``."""
    newest = set(sorted(steps, reverse=True)[:keep_last])
    return sorted(s for s in steps if s not in newest and not (keep_every and s % keep_every == 0))


def weights_to_delete(
    versions: list[int], keep_last: int, needed: set[int], exported_at: dict[int, float], now: float, grace_s: float
) -> list[int]:
    """Retention of exported weights: keep the newest ``keep_last``, every version in ``needed``, and
    every version superseded less than ``grace_s`` ago (an engine that started on it may still be loading it)."""
    ordered = sorted(versions)
    newest = set(ordered[-keep_last:])
    superseded = {v: exported_at.get(nxt, now) for v, nxt in zip(ordered, ordered[1:])}
    return [v for v in ordered if v not in newest and v not in needed and now - superseded[v] >= grace_s]


def newest_committed_snapshot(workdir: Path) -> SnapshotInfo | None:
    """The newest snapshot with a manifest, without re-reading its files (for `erl status`)."""
    for step in _steps(workdir):
        manifest = read_manifest(snapshot_path(workdir, step))
        if manifest is not None:
            return SnapshotInfo(
                step=step, path=snapshot_path(workdir, step), last_rollout=int(manifest["last_rollout"])
            )
    return None


def valid_steps(workdir: Path) -> list[int]:
    return sorted(step for step in _steps(workdir) if verify(snapshot_path(workdir, step)) is None)
