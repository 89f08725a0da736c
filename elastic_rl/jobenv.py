"""The environment erld gives a job's processes.

Each process of a job reads its configuration from these variables: the job
id, its work dir, the resolved spec (a JSON file in the work dir, see
``checkpoints.layout``) and the addresses of the job's servers. No torch
here: the CLI uses this module.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import orjson

from checkpoints.layout import spec_path
from elastic_rl.atomic import write_file_atomic
from elastic_rl.spec.job import JobSpec

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
SECRET = "ERL_JOB_SECRET"
"""The job's secret, which its endpoints that change state ask for (``elastic_rl.job_secret``)."""
ADVERTISE_HOST = "ERL_ADVERTISE_HOST"
"""The address of the process's node that its servers bind and peers reach."""
DEVICE_KIND = "ERL_DEVICE_KIND"
"""cpu or cuda: what the process computes on (``policies.devices``); unset means cpu."""
SLOTS = "ERL_SLOTS"
"""The node's device slots the process holds (``4,5``), numbered as erld and its users number them;
on CUDA, ``CUDA_VISIBLE_DEVICES`` names the same GPUs as CUDA numbers them, which may differ."""

# Set by erld from the device rule, read by CUDA, torch and NCCL themselves.
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
CUBLAS_WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
NCCL_HEARTBEAT_TIMEOUT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
NCCL_RETHROW_CUDA_ERRORS = "TORCH_NCCL_RETHROW_CUDA_ERRORS"
NCCL_NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
SGLANG_HEALTH_GENERATION = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
"""Off in an SGLang engine's environment (``engines.launcher.engine_env``): its /health then only
says that the server answers (erld judges a hang by the engine's progress counter instead)."""


def spec_hash(spec: JobSpec) -> str:
    """A short hash of the resolved spec, recorded in every snapshot."""
    return hashlib.sha256(orjson.dumps(spec.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def write_spec(workdir: Path, spec: JobSpec) -> Path:
    path = spec_path(workdir)
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
        spec = JobSpec.model_validate(orjson.loads(spec_path(workdir).read_bytes()))
        return cls(job=os.environ[JOB], workdir=workdir, spec=spec)
