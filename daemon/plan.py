"""A job's processes: their names, roles and groups, and each one's command line and environment.

The plan is pure: the spec gives the groups to place (``policies.placement``)
and the processes of each; an assignment (which node, slots, port and
generation the controller chose), the kind of the node's slots and the job's
service addresses give a process's command and environment, its device by
the device rule (``policies.devices``). Every URL a process is given is built
from the advertise host of the node its server runs on.

    services        lighthouse, router, orchestrator (one node, no device slot)
    engine-<i>      engine-<i>                  (engines.tp_size slots on one node; one for a cpu engine)
    teacher-<i>     teacher-<i>                 (a distillation teacher's engine: its tp_size slots on one node)
    replica-<k>     trainer-<k>-<rank>          (trainer.ranks_per_replica slots on one node)
    spare-<s>       spare-<s>-<rank>            (likewise, warm spares)

Colocated (``placement: colocated``), engine-<i> takes no slot of its own: it
shares engines.tp_size slots of replica-<k> (k = i // the engines per replica),
and moves with that replica.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from checkpoints import layout
from daemon.notify import child_environment
from elastic_rl import jobenv
from elastic_rl.engines.launcher import engine_command, engine_env
from elastic_rl.engines.router import router_command
from elastic_rl.net import url
from elastic_rl.spec.engines import EnginesSpec
from elastic_rl.spec.job import JobSpec
from elastic_rl.store.devices import assignment_slots
from policies.devices import DeviceKind, NcclSettings, Precision, ProcessDevice, nccl_settings, process_device
from policies.placement import Group, GroupKind

SERVICES = "services"
TEACHER_VERSION = "teacher"
"""The weight version a teacher engine reports: its checkpoint, never updated."""


class Role(Enum):
    LIGHTHOUSE = "lighthouse"
    ROUTER = "router"
    ORCHESTRATOR = "orchestrator"
    ENGINE = "engine"
    TEACHER = "teacher"
    TRAINER = "trainer"
    SPARE = "spare"


ENGINE_ROLES = (Role.ENGINE, Role.TEACHER)
"""The inference servers: the policy's engines and a distillation teacher's."""


@dataclass(frozen=True)
class ProcSpec:
    name: str
    role: Role
    group: str
    rank: int = 0

    @property
    def group_index(self) -> int:
        """k of replica-k, s of spare-s, i of engine-i or teacher-i."""
        return int(self.group.rsplit("-", 1)[1])


def job_groups(spec: JobSpec) -> list[Group]:
    ranks = spec.trainer.ranks_per_replica
    replicas, spares = spec.trainer_groups
    on_gpu = _trainers_on_gpu(spec)
    groups = [Group(SERVICES, GroupKind.SERVICES, 0)]
    groups += [engine_group(spec, i) for i in range(spec.engine_count)]
    teachers = teacher_engine_settings(spec)
    if teachers is not None:
        count = spec.teacher_engines.count
        groups += [
            Group(f"teacher-{i}", GroupKind.TEACHER, teachers.slots, teachers.kind == "sglang") for i in range(count)
        ]
    groups += [replica_group(spec, k) for k in range(replicas)]
    groups += [Group(f"spare-{s}", GroupKind.SPARE, ranks, on_gpu) for s in range(spares)]
    return groups


def replica_group(spec: JobSpec, index: int) -> Group:
    return Group(f"replica-{index}", GroupKind.REPLICA, spec.trainer.ranks_per_replica, _trainers_on_gpu(spec))


def _trainers_on_gpu(spec: JobSpec) -> bool:
    # bf16 (either kind), and a broadcast of the weights into the engines over NCCL, need the trainers on GPUs.
    return spec.trainer.dtype is not Precision.FP32 or spec.engines.weight_sync == "distributed"


def engine_group(spec: JobSpec, index: int) -> Group:
    group = Group(f"engine-{index}", GroupKind.ENGINE, spec.engines.slots, spec.engines.kind == "sglang")
    if not spec.colocated:
        return group
    replica, shard = divmod(index, spec.engines_per_replica)
    shared = tuple(range(shard * spec.engines.slots, (shard + 1) * spec.engines.slots))
    return replace(group, host=f"replica-{replica}", host_slots=shared)


def teacher_engine_settings(spec: JobSpec) -> EnginesSpec | None:
    """How a distillation teacher's engines are started and checked, when the job serves one."""
    return None if spec.teacher_engines is None else spec.teacher_engines.as_engines(spec.engines)


def group_procs(group: Group) -> list[ProcSpec]:
    """The processes of a group, in the order their device slots are given."""
    if group.kind is GroupKind.SERVICES:
        return [ProcSpec(role.value, role, SERVICES) for role in (Role.LIGHTHOUSE, Role.ROUTER, Role.ORCHESTRATOR)]
    if group.kind is GroupKind.ENGINE:
        return [ProcSpec(group.name, Role.ENGINE, group.name)]
    if group.kind is GroupKind.TEACHER:
        return [ProcSpec(group.name, Role.TEACHER, group.name)]
    index = group.name.rsplit("-", 1)[1]
    role, prefix = (Role.TRAINER, "trainer") if group.kind is GroupKind.REPLICA else (Role.SPARE, "spare")
    return [ProcSpec(f"{prefix}-{index}-{rank}", role, group.name, rank) for rank in range(group.slots)]


def proc_spec(name: str) -> ProcSpec:
    """The spec of a process from its name alone."""
    if name in (role.value for role in (Role.LIGHTHOUSE, Role.ROUTER, Role.ORCHESTRATOR)):
        return ProcSpec(name, Role(name), SERVICES)
    if name.startswith("engine-"):
        return ProcSpec(name, Role.ENGINE, name)
    if name.startswith("teacher-"):
        return ProcSpec(name, Role.TEACHER, name)
    prefix, index, rank = name.rsplit("-", 2)
    role = Role.TRAINER if prefix == "trainer" else Role.SPARE
    return ProcSpec(name, role, f"{'replica' if role is Role.TRAINER else 'spare'}-{index}", int(rank))


@dataclass(frozen=True)
class Endpoints:
    """Where the job's servers are, from their assignments."""

    router: str
    lighthouse: str


def process_env(
    proc: ProcSpec,
    assignment: dict,
    endpoints: Endpoints,
    base: dict[str, str],
    advertise_host: str,
    spec: JobSpec,
    node_kind: DeviceKind,
    gpu_ids: Sequence[str] = (),
) -> dict[str, str]:
    """``gpu_ids``: on a GPU node, its GPUs' CUDA indices, slot i's at i (``daemon.gpus``)."""
    env = {
        **base,
        jobenv.PROC: proc.name,
        jobenv.GENERATION: str(assignment["generation"]),
        jobenv.ADVERTISE_HOST: advertise_host,
        jobenv.ROUTER_URL: endpoints.router,
        jobenv.LIGHTHOUSE_URL: endpoints.lighthouse,
    }
    if assignment.get("device") is not None:
        env[jobenv.DEVICE] = str(assignment["device"])
    trainer = proc.role in (Role.TRAINER, Role.SPARE)
    served = _served_by(proc, spec)
    uses_gpu = trainer or (served is not None and served.kind == "sglang")
    device = process_device(node_kind, assignment_slots(assignment), uses_gpu)
    ft = spec.fault_tolerance
    nccl = nccl_settings(ft.quorum_timeout_s, ft.collective_timeout_s) if trainer else None
    env.update(device_env(device, gpu_ids, nccl))
    if served is not None:
        env.update(engine_env(served))
    if trainer:
        identity = jobenv.REPLICA if proc.role is Role.TRAINER else jobenv.SPARE
        env.update(
            {
                identity: str(proc.group_index),
                "RANK": str(proc.rank),
                "LOCAL_RANK": str(proc.rank),
                "WORLD_SIZE": str(spec.trainer.ranks_per_replica),
                "MASTER_ADDR": advertise_host,
            }
        )
    return env


def node_environment() -> dict[str, str]:
    """What every process erld starts begins with, before its job's and its own: erld's environment
    less what belongs to erld alone, unbuffered output, one OpenMP thread, and no GPU seen (a process
    with a slot is given its device by ``device_env``)."""
    return {
        **child_environment(),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        **device_env(ProcessDevice(DeviceKind.CPU)),
    }


def device_env(device: ProcessDevice, gpu_ids: Sequence[str] = (), nccl: NcclSettings | None = None) -> dict[str, str]:
    """The environment that carries the device rule's decision into a process (and to CUDA, torch
    and NCCL): its slots, and the GPUs it sees (``gpu_ids``: the node's CUDA indices in PCI bus
    order, slot i's at i); on CUDA, cuBLAS's deterministic workspace and, for a trainer under
    torchft, NCCL's timeouts."""
    env = {
        jobenv.DEVICE_KIND: device.kind.value,
        jobenv.SLOTS: ",".join(str(slot) for slot in device.slots),
        jobenv.CUDA_VISIBLE_DEVICES: device.visible_devices(gpu_ids),
    }
    if device.kind is not DeviceKind.CUDA:
        return env
    env.update({jobenv.CUDA_DEVICE_ORDER: "PCI_BUS_ID", jobenv.CUBLAS_WORKSPACE_CONFIG: ":4096:8"})
    if nccl is not None:
        env.update(
            {
                jobenv.NCCL_HEARTBEAT_TIMEOUT: str(nccl.heartbeat_timeout_s),
                jobenv.NCCL_NONBLOCKING_TIMEOUT: str(nccl.nonblocking_timeout_s),
                jobenv.NCCL_RETHROW_CUDA_ERRORS: "1" if nccl.rethrow_cuda_errors else "0",
            }
        )
    return env


def command(proc: ProcSpec, assignment: dict, spec: JobSpec, workdir: Path, advertise_host: str) -> list[str]:
    """The command line; engines start on the newest weights, so a replacement serves the current version."""
    if proc.role is Role.LIGHTHOUSE:
        ft = spec.fault_tolerance
        return [
            str(Path(sys.executable).parent / "torchft_lighthouse"),
            "--min_replicas",
            "1",
            "--bind",
            f"{advertise_host}:{assignment['port']}",
            "--heartbeat_timeout_ms",
            str(ft.heartbeat_timeout_ms),
            "--join_timeout_ms",
            str(ft.join_timeout_ms),
        ]
    if proc.role is Role.ROUTER:
        return router_command(assignment["port"], assignment["metrics_port"], host=advertise_host)
    if proc.role is Role.ORCHESTRATOR:
        return [sys.executable, "-m", "elastic_rl.rollout.orchestrator"]
    if proc.role is Role.ENGINE:
        version = layout.latest_weights_version(workdir) or 0
        return engine_command(
            spec.engines,
            layout.weights_dir(workdir, version),
            assignment["port"],
            host=advertise_host,
            weight_version=str(version),
            deterministic=spec.rollout.deterministic,
            # A chunk per token: with everything so far in each, a long response would cost its square.
            incremental_streaming=True,
            colocated=spec.colocated,
            routed_experts=spec.algorithm.routing_replay,
        )
    if proc.role is Role.TEACHER:
        return engine_command(
            teacher_engine_settings(spec),
            spec.algorithm.distillation.teacher,
            assignment["port"],
            host=advertise_host,
            weight_version=TEACHER_VERSION,
            deterministic=spec.rollout.deterministic,
        )
    return [sys.executable, "-m", "elastic_rl.trainer.main"]


def _served_by(proc: ProcSpec, spec: JobSpec) -> EnginesSpec | None:
    """The engines spec of an engine process (the policy's or a teacher's); None for any other."""
    if proc.role is Role.ENGINE:
        return spec.engines
    return teacher_engine_settings(spec) if proc.role is Role.TEACHER else None


def server_url(assignment: dict) -> str:
    """The URL of an assigned server, on the advertise host of its node (written into the assignment)."""
    return url(assignment["port"], host=assignment["host"])
