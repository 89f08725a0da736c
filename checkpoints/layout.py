"""The layout of a job's work dir, and the rule that ties rollouts to weight versions.

Every path a job's processes, erld, the CLI and the chaos harness read or write
in a work dir is named here, and nowhere else:

    spec.json                 the resolved spec
    events.jsonl              every event (also in etcd)
    metrics.jsonl             one line per trained rollout
    logs/<proc>.log           each process's output
    exits/<pid>.json          the exit code a trainer process ended with (elastic_rl.exit_record)
    rollouts/<N>/             the rollout log (checkpoints.rollout_log)
    rollouts/inflight-<N>.jsonl   what rollout N has generated before its commit (checkpoints.inflight_log)
    engine_tokens/<node>.json     each engine's generated-token counter as erld last read it
    quarantine/rollout-<N>.json   rollouts the NaN guard set aside
    snapshots/<step>/         DCP snapshots (checkpoints.snapshot)
    weights/<version>/        HF weights for the engines
    metrics/train-<N>.json    the trainers' metrics of rollout N
    rendezvous/, spares/      how trainer processes find each other and their places
    rewound/<time>/           what `erl resume --snapshot` moved aside

The version rule: weights version 0 is the initial model, and training on
rollout N publishes version N + 1. No torch here: the CLI uses this module.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson

SPEC_FILE = "spec.json"
META_FILE = "meta.json"


# --- the version rule -----------------------------------------------------------------


def version_after(rollout_id: int) -> int:
    """The weights version training on ``rollout_id`` publishes."""
    return rollout_id + 1


def version_before(rollout_id: int) -> int:
    """The weights trained on every rollout before ``rollout_id``: the newest it can be generated with."""
    return version_after(rollout_id - 1)


# --- files ------------------------------------------------------------------------------


def spec_path(workdir: Path) -> Path:
    return workdir / SPEC_FILE


def events_path(workdir: Path) -> Path:
    return workdir / "events.jsonl"


def metrics_lines_path(workdir: Path) -> Path:
    return workdir / "metrics.jsonl"


def read_lines(path: Path) -> list[dict]:
    """The records of a JSON-lines file (events.jsonl, metrics.jsonl); none before it exists. A last line
    still being appended is left out."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    return [orjson.loads(line) for line in raw[: raw.rfind(b"\n") + 1].splitlines()]


def logs_dir(workdir: Path) -> Path:
    return workdir / "logs"


def proc_log_path(workdir: Path, proc: str) -> Path:
    return logs_dir(workdir) / f"{proc}.log"


def exit_record_path(workdir: Path, pid: int) -> Path:
    return workdir / "exits" / f"{pid}.json"


def train_metrics_path(workdir: Path, rollout_id: int) -> Path:
    return workdir / "metrics" / f"train-{rollout_id:06d}.json"


def phase_memory_dir(workdir: Path, rollout_id: int) -> Path:
    """Colocated: each trainer rank's peak memory in the phases around a rollout (``trainer.offload``)."""
    return workdir / "memory" / f"{rollout_id:06d}"


def phase_memory_path(workdir: Path, rollout_id: int, proc: str) -> Path:
    return phase_memory_dir(workdir, rollout_id) / f"{proc}.json"


def rewound_dir(workdir: Path, stamp: str) -> Path:
    return workdir / "rewound" / stamp


# --- the rollout log ------------------------------------------------------------------


def rollout_dir(workdir: Path, rollout_id: int) -> Path:
    return workdir / "rollouts" / f"{rollout_id:06d}"


def committed_rollouts(workdir: Path) -> list[int]:
    """Ids of the rollouts whose folders are complete (the folder appears atomically)."""
    folder = workdir / "rollouts"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / META_FILE).is_file())


def inflight_path(workdir: Path, rollout_id: int) -> Path:
    return workdir / "rollouts" / f"inflight-{rollout_id:06d}.jsonl"


def inflight_rollouts(workdir: Path) -> list[int]:
    """Ids of the rollouts with an in-flight log."""
    folder = workdir / "rollouts"
    if not folder.is_dir():
        return []
    return sorted(int(p.stem.removeprefix("inflight-")) for p in folder.glob("inflight-*.jsonl"))


def quarantine_path(workdir: Path, rollout_id: int) -> Path:
    return workdir / "quarantine" / f"rollout-{rollout_id:06d}.json"


def quarantined_rollouts(workdir: Path) -> set[int]:
    """Rollouts the NaN guard set aside: trainers skip them, on a replay too."""
    folder = workdir / "quarantine"
    if not folder.is_dir():
        return set()
    return {int(p.stem.removeprefix("rollout-")) for p in folder.glob("rollout-*.json")}


# --- snapshots and weights ---------------------------------------------------------------


def snapshot_root(workdir: Path) -> Path:
    return workdir / "snapshots"


def snapshot_path(workdir: Path, step: int) -> Path:
    return snapshot_root(workdir) / f"{step:09d}"


def weights_root(workdir: Path) -> Path:
    return workdir / "weights"


def weights_dir(workdir: Path, version: int) -> Path:
    return weights_root(workdir) / str(version)


def weights_versions(workdir: Path) -> list[int]:
    """The exported weight versions, oldest first (a folder appears atomically, whole)."""
    folder = weights_root(workdir)
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def latest_weights_version(workdir: Path) -> int | None:
    return max(weights_versions(workdir), default=None)


SHARED_MEMORY = Path("/dev/shm/elastic-rl")
"""Where weights passed in memory live (engines.weight_sync memory): a tmpfs on every Linux node."""


def memory_weights_root(workdir: Path) -> Path:
    """This job's weights in each node's shared memory: the same path on every node, one per work dir."""
    digest = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:12]
    return SHARED_MEMORY / f"{workdir.name}-{digest}"


def memory_weights_dir(workdir: Path, version: int) -> Path:
    return memory_weights_root(workdir) / str(version)


def memory_weights_marker(workdir: Path, version: int) -> Path:
    """Written (in the work dir) once the publishing replica has put ``version`` in its node's shared memory."""
    return workdir / "weights_in_memory" / str(version)


def engine_tokens_path(workdir: Path, node: str) -> Path:
    """The tokens each engine of the job on ``node`` had generated when erld last read its counter."""
    return workdir / "engine_tokens" / f"{node}.json"


def engine_tokens_files(workdir: Path) -> list[Path]:
    folder = workdir / "engine_tokens"
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


# --- trainer processes -------------------------------------------------------------------


def rendezvous_path(workdir: Path, group: str, started: int) -> Path:
    """Where a trainer group that started at ``started`` (ns) meets; a later start meets elsewhere."""
    return workdir / "rendezvous" / f"{group}-{started}.port"


def spare_assignment_path(workdir: Path, spare: str) -> Path:
    """erld writes {"replica": k, "generation": g} here when the warm spare ``spare-<s>-<generation>``
    takes replica k's place (a spare started later has another generation, so another file)."""
    return workdir / "spares" / f"{spare}.json"
