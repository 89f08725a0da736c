"""This node's GPUs as `erl daemon --gpus` offers them: found through NVML (nvidia-ml-py), known by UUID,
with the memory of each (the node record's ``slot_memory``, what `erl submit` checks a job against).

``--gpus all`` offers every GPU erld may use, ``--gpus N`` the first N of
them: every GPU NVML sees or, where erld itself was started with a
``CUDA_VISIBLE_DEVICES`` (a scheduler's share of the machine), only the GPUs
that lists, in its order. Slot i is the i-th GPU offered; users and the
controller see slots 0 to N-1.

A process on slot i is given that GPU's CUDA index in ``CUDA_VISIBLE_DEVICES``
with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (``daemon.plan``): its place among the
node's GPUs sorted by PCI bus id, which is how CUDA then numbers them, found
from the GPU's own PCI bus id, so NVML's enumeration order decides nothing.
Not its UUID, which CUDA and torch accept: SGLang's custom all-reduce (an
engine with tp_size > 1) reads ``CUDA_VISIBLE_DEVICES`` as integers. Finding
the GPUs needs NVIDIA's driver, not CUDA or torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import pynvml

from elastic_rl import jobenv
from elastic_rl.errors import InputError

log = logging.getLogger("erld.gpus")


@dataclass(frozen=True)
class Gpu:
    uuid: str
    pci: tuple[int, int, int]
    """PCI domain, bus and device: CUDA_DEVICE_ORDER=PCI_BUS_ID numbers the GPUs in this order."""
    memory: int
    """Its device memory in bytes."""


@dataclass(frozen=True)
class NodeGpus:
    cuda_indices: tuple[str, ...]
    """What ``CUDA_VISIBLE_DEVICES`` names the GPU of each slot by, slot i's at i."""
    slot_memory: int
    """Bytes of device memory of the smallest GPU offered: what one slot can hold."""


def node_gpus(request: str, nvml: ModuleType = pynvml, environ: Mapping[str, str] = os.environ) -> NodeGpus:
    """The GPUs ``--gpus REQUEST`` gives this node as slots, slot i's at i, each named by its CUDA index
    in PCI bus order."""
    found = sorted(nvml_gpus(nvml), key=lambda gpu: gpu.pci)
    memory = {gpu.uuid: gpu.memory for gpu in found}
    cuda_order = [gpu.uuid for gpu in found]
    inherited = environ.get(jobenv.CUDA_VISIBLE_DEVICES)
    usable = allowed_gpus(cuda_order, inherited)
    numbered = inherited is not None and any(entry.strip().isdigit() for entry in inherited.split(","))
    if numbered and environ.get(jobenv.CUDA_DEVICE_ORDER) != "PCI_BUS_ID":
        log.warning(
            "CUDA_VISIBLE_DEVICES numbers GPUs: erld reads the numbers in PCI bus order, which CUDA "
            "uses only with CUDA_DEVICE_ORDER=PCI_BUS_ID; give UUIDs to be sure"
        )
    offered = usable[: slots_for(request, len(usable))]
    for slot, uuid in enumerate(offered):
        log.info("slot %d: GPU %s (CUDA device %d in PCI bus order)", slot, uuid, cuda_order.index(uuid))
    return NodeGpus(tuple(str(cuda_order.index(uuid)) for uuid in offered), min(memory[uuid] for uuid in offered))


def slots_for(request: str, found: int) -> int:
    """``all`` or a count, checked against the ``found`` GPUs."""
    if request == "all":
        if found == 0:
            raise InputError("--gpus all: NVML sees no GPU on this node; on a CPU node use --cpu-devices N")
        return found
    try:
        wanted = int(request)
    except ValueError:
        raise InputError(f"--gpus {request!r}: give `all` or a number of GPUs, e.g. --gpus 4") from None
    if wanted < 1:
        raise InputError(f"--gpus {wanted}: give at least 1 GPU, or `all`")
    if wanted > found:
        raise InputError(
            f"--gpus {wanted}: this node has {found} GPU(s) erld may use; ask for at most {found}, or `all`"
        )
    return wanted


def allowed_gpus(uuids: list[str], inherited: str | None) -> list[str]:
    """The GPUs of ``uuids`` (in PCI bus order) that an inherited ``CUDA_VISIBLE_DEVICES`` leaves erld,
    in the order it lists them: each entry an index into ``uuids`` or a GPU's UUID (or a unique start
    of one, as CUDA accepts). Unset: all of them."""
    if inherited is None:
        return list(uuids)
    chosen: list[str] = []
    for entry in (part.strip() for part in inherited.split(",")):
        if not entry:
            continue
        if entry.isdigit():
            if int(entry) >= len(uuids):
                raise InputError(f"CUDA_VISIBLE_DEVICES={inherited}: NVML sees {len(uuids)} GPU(s), no GPU {entry}")
            uuid = uuids[int(entry)]
        else:
            matches = [uuid for uuid in uuids if uuid.startswith(entry)]
            if len(matches) != 1:
                found = "no GPU" if not matches else f"{len(matches)} GPUs"
                raise InputError(
                    f"CUDA_VISIBLE_DEVICES={inherited}: {entry!r} names {found} NVML sees; give GPU indices or "
                    "UUIDs (`nvidia-smi -L`); a MIG instance cannot be a slot, which is a whole GPU"
                )
            uuid = matches[0]
        if uuid not in chosen:
            chosen.append(uuid)
    if not chosen:
        raise InputError(f"CUDA_VISIBLE_DEVICES={inherited!r} in erld's environment leaves it no GPU")
    return chosen


def nvml_gpus(nvml: ModuleType = pynvml) -> list[Gpu]:
    """Every GPU NVML sees, with its UUID and PCI address."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise InputError(
            f"--gpus: NVML cannot list this node's GPUs ({exc}); is NVIDIA's driver installed? "
            "On a CPU node use --cpu-devices N"
        ) from None
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            pci = nvml.nvmlDeviceGetPciInfo(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle).total
            name = uuid.decode() if isinstance(uuid, bytes) else uuid
            gpus.append(Gpu(name, (pci.domain, pci.bus, pci.device), memory))
        return gpus
    finally:
        nvml.nvmlShutdown()
