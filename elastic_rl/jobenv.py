"""The environment erld gives a job's processes, and the layout of a job's work dir.

Each process of a job reads its configuration from these variables: the job
id, its work dir, the resolved spec (a JSON file in the work dir) and the
addresses of the job's servers. The path helpers name where each kind of
bulk data lives in the work dir. No torch here: the CLI uses this module.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import orjson

from elastic_rl.atomic import write_file_atomic
from elastic_rl.config import JobSpec

JOB = "ERL_JOB"
PROC = "ERL_PROC"
WORKDIR = "ERL_WORKDIR"
ETCD = "ERL_ETCD"
ROUTER_URL = "ERL_ROUTER_URL"
LIGHTHOUSE_URL = "ERL_LIGHTHOUSE_URL"
REPLICA = "ERL_REPLICA"
DEVICE = "ERL_DEVICE"
SPARE = "ERL_SPARE"
NODE = "ERL_NODE"
"""The node whose erld started the process (the chaos harness kills a node's processes by it)."""
GENERATION = "ERL_GENERATION"
"""The generation of the process's assignment: a process whose assignment moved on never commits."""
RENDEZVOUS = "ERL_RENDEZVOUS"
"""A file in the work dir where rank 0 of a trainer group writes the port of the group's store."""
ADVERTISE_HOST = "ERL_ADVERTISE_HOST"
"""The address of the process's node that its servers bind and peers reach."""
DEVICE_KIND = "ERL_DEVICE_KIND"
"""cpu or cuda: what the process computes on (``policies.devices``); unset means cpu."""

# Set by erld from the device rule, read by CUDA, torch and NCCL themselves.
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
CUBLAS_WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
NCCL_HEARTBEAT_TIMEOUT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
NCCL_RETHROW_CUDA_ERRORS = "TORCH_NCCL_RETHROW_CUDA_ERRORS"
NCCL_NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"

SPEC_FILE = "spec.json"
META_FILE = "meta.json"


def spec_hash(spec: JobSpec) -> str:
    """A short hash of the resolved spec, recorded in every snapshot."""
    return hashlib.sha256(orjson.dumps(spec.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def write_spec(workdir: Path, spec: JobSpec) -> Path:
    path = workdir / SPEC_FILE
    write_file_atomic(path, orjson.dumps(spec.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS))
    return path


@dataclass(frozen=True)
class JobEnv:
    job: str
    workdir: Path
    spec: JobSpec

    @classmethod
    def from_environ(cls) -> JobEnv:
        missing = [name for name in (JOB, WORKDIR) if name not in os.environ]
        if missing:
            raise RuntimeError(f"not started by erld: {', '.join(missing)} unset")
        workdir = Path(os.environ[WORKDIR])
        spec = JobSpec.model_validate(orjson.loads((workdir / SPEC_FILE).read_bytes()))
        return cls(job=os.environ[JOB], workdir=workdir, spec=spec)


def weights_root(workdir: Path) -> Path:
    return workdir / "weights"


def weights_dir(workdir: Path, version: int) -> Path:
    return weights_root(workdir) / str(version)


def train_metrics_path(workdir: Path, rollout_id: int) -> Path:
    return workdir / "metrics" / f"train-{rollout_id:06d}.json"


def weights_versions(workdir: Path) -> list[int]:
    """The exported weight versions, oldest first (a folder appears atomically, whole)."""
    folder = weights_root(workdir)
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def latest_weights_version(workdir: Path) -> int | None:
    return max(weights_versions(workdir), default=None)


def rollout_dir(workdir: Path, rollout_id: int) -> Path:
    return workdir / "rollouts" / f"{rollout_id:06d}"


def committed_rollouts(workdir: Path) -> list[int]:
    """Ids of the rollouts whose folders are complete (the folder appears atomically)."""
    folder = workdir / "rollouts"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / META_FILE).is_file())


def quarantine_path(workdir: Path, rollout_id: int) -> Path:
    return workdir / "quarantine" / f"rollout-{rollout_id:06d}.json"


def quarantined_rollouts(workdir: Path) -> set[int]:
    """Rollouts the NaN guard set aside: trainers skip them, on a replay too."""
    folder = workdir / "quarantine"
    if not folder.is_dir():
        return set()
    return {int(p.stem.removeprefix("rollout-")) for p in folder.glob("rollout-*.json")}


def rendezvous_path(workdir: Path, group: str, started: int) -> Path:
    """Where a trainer group that started at ``started`` (ns) meets; a later start meets elsewhere."""
    return workdir / "rendezvous" / f"{group}-{started}.port"


def spare_assignment_path(workdir: Path, spare: str) -> Path:
    """erld writes {"replica": k, "generation": g} here when the warm spare ``spare-<s>-<generation>``
    takes replica k's place (a spare started later has another generation, so another file)."""
    return workdir / "spares" / f"{spare}.json"
