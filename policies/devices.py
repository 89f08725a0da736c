"""The device rule: what each job process computes on, and how its process groups talk.

Pure: the kind of a node's device slots (``erl daemon --gpus`` or
``--cpu-devices``), the slots erld assigned a process and whether the process
computes on a GPU when it has one, in; the process's device, the backend of
its process groups, torchft's cross-replica group and the settings erld puts
in its environment, out. Every part goes through this one rule: erld when it
starts a process (``daemon.plan``), and inside the process the trainer, its
torchft Manager, the model builder and the collectives (``elastic_rl.device``).

- A process on CUDA slots that computes on a GPU (a trainer rank, an SGLang
  engine) sees exactly its slots (``CUDA_VISIBLE_DEVICES``: the CUDA indices,
  in PCI bus order, of the GPUs ``erl daemon --gpus`` gave those slots) and
  computes on its first visible GPU, ``cuda:0``; its groups use NCCL.
- Every other process (one on a CPU slot, one with no slot, a cpu engine)
  sees no GPU at all and uses gloo, with megatron's CPU shim.
- torchft's cross-replica group: gloo on CPU; on CUDA ``ProcessGroupNCCL``
  (aborts a stuck communicator and recovers in process) or
  ``ProcessGroupBabyNCCL`` (NCCL in a child process, so a dead peer cannot
  take the trainer down with it), as the job asks.
- NCCL hygiene for a GPU trainer: the NCCL heartbeat monitor ends a rank whose
  watchdog is stuck within half the quorum timeout, before the survivors give
  up on the quorum; CUDA errors of a communicator torchft aborted are not
  re-thrown (it recovers in process); torchft's nonblocking NCCL calls time
  out after the collective timeout, not NCCL's 30 minutes. cuBLAS gets the
  workspace that deterministic algorithms need.
- Precision: fp32 anywhere; bf16 (megatron's autocast mixed precision: fp32
  parameters and gradients, bf16 matrix products) only on CUDA, since
  megatron's autocast hooks (``custom_fwd``/``custom_bwd``) are CUDA's alone:
  on CPU the backward pass mixes bf16 and fp32 and fails; bf16-params
  (megatron's bf16 parameters with fp32 main weights in its distributed
  optimizer) only on CUDA too, since that optimizer refuses CPU tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum


class DeviceKind(Enum):
    """What a node's device slots are."""

    CPU = "cpu"
    CUDA = "cuda"


class Backend(Enum):
    """The torch.distributed backend of a process's groups."""

    GLOO = "gloo"
    NCCL = "nccl"


class CrossReplicaGroup(Enum):
    """torchft's process group between replicas."""

    GLOO = "gloo"
    NCCL = "nccl"
    BABY_NCCL = "baby_nccl"


class Precision(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    BF16_PARAMS = "bf16-params"


@dataclass(frozen=True)
class ProcessDevice:
    """Where one process computes."""

    kind: DeviceKind
    slots: tuple[int, ...] = ()
    """The node's device slots the process holds (none for the services)."""

    @property
    def torch_device(self) -> str:
        """The device of the process's tensors, as torch names it inside the process."""
        return "cuda:0" if self.kind is DeviceKind.CUDA else "cpu"

    @property
    def backend(self) -> Backend:
        return Backend.NCCL if self.kind is DeviceKind.CUDA else Backend.GLOO

    def visible_devices(self, gpu_ids: Sequence[str]) -> str:
        """``CUDA_VISIBLE_DEVICES``: the process's GPUs, or none. ``gpu_ids``: what CUDA names the node's
        GPUs by, slot i's at i."""
        return ",".join(gpu_ids[slot] for slot in self.slots) if self.kind is DeviceKind.CUDA else ""


def process_device(node_kind: DeviceKind, slots: tuple[int, ...], uses_gpu: bool) -> ProcessDevice:
    """The device of a process holding ``slots`` on a node of ``node_kind``. ``uses_gpu``: whether the
    process computes on a GPU when it has one (trainer ranks and SGLang engines do; the services and
    the cpu engine never do)."""
    kind = DeviceKind.CUDA if node_kind is DeviceKind.CUDA and slots and uses_gpu else DeviceKind.CPU
    return ProcessDevice(kind, tuple(slots))


def cross_replica_group(device: ProcessDevice, on_gpu: CrossReplicaGroup) -> CrossReplicaGroup:
    """torchft's group between replicas: gloo on CPU; ``on_gpu`` (NCCL or its child-process variant) on CUDA."""
    if device.kind is DeviceKind.CPU:
        return CrossReplicaGroup.GLOO
    if on_gpu is CrossReplicaGroup.GLOO:
        raise ValueError("a replica on CUDA joins its peers over NCCL (nccl or baby_nccl), not gloo")
    return on_gpu


@dataclass(frozen=True)
class NcclSettings:
    """What a GPU trainer's NCCL runs with (erld writes it into the environment)."""

    heartbeat_timeout_s: int
    """TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: a rank whose NCCL watchdog is stuck this long is ended."""
    nonblocking_timeout_s: int
    """TORCH_NCCL_NONBLOCKING_TIMEOUT: torchft's nonblocking NCCL calls give up after this."""
    rethrow_cuda_errors: bool = False
    """TORCH_NCCL_RETHROW_CUDA_ERRORS: off, so an aborted communicator's error does not end the
    process that torchft recovers in."""


def nccl_settings(quorum_timeout_s: float, collective_timeout_s: float) -> NcclSettings:
    """NCCL's timeouts for a trainer under torchft: the heartbeat below the quorum timeout (half of
    it, at least a second), nonblocking calls bounded by the cross-replica collective timeout."""
    return NcclSettings(
        heartbeat_timeout_s=max(1, math.floor(quorum_timeout_s / 2)),
        nonblocking_timeout_s=max(1, math.ceil(collective_timeout_s)),
    )


def precision_problem(device: ProcessDevice, precision: Precision) -> str | None:
    """Why ``precision`` cannot run on ``device``, or None when it can."""
    if precision is Precision.BF16 and device.kind is not DeviceKind.CUDA:
        return (
            "trainer.dtype bf16 needs a CUDA slot: megatron's mixed precision (autocast) runs only on "
            "CUDA, and this rank was given a CPU one; set trainer.dtype: fp32, or run the job on nodes "
            "started with `erl daemon --gpus`"
        )
    if precision is Precision.BF16_PARAMS and device.kind is not DeviceKind.CUDA:
        return (
            "trainer.dtype bf16-params needs a CUDA slot: megatron's distributed optimizer, which holds the "
            "fp32 main weights, refuses CPU tensors, and this rank was given a CPU one; set trainer.dtype: "
            "fp32, or run the job on nodes started with `erl daemon --gpus`"
        )
    return None


def offload_problem(device: ProcessDevice) -> str | None:
    """Why ``trainer.optimizer_offload`` cannot run on ``device``, or None when it can."""
    if device.kind is DeviceKind.CUDA:
        return None
    return (
        "trainer.optimizer_offload needs a CUDA slot: it moves AdamW's state from the device to host memory, "
        "and on this rank's CPU slot host memory is the device; drop trainer.optimizer_offload, or run the "
        "job on nodes started with `erl daemon --gpus`"
    )
