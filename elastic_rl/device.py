"""This process's device as erld assigned it (the device rule, ``policies.devices``), applied to torch.

erld writes the rule's decision into a process's environment
(``ERL_DEVICE_KIND``, ``ERL_SLOTS``, ``CUDA_VISIBLE_DEVICES``); ``assigned()`` reads it
back. A process started any other way (a test's worker, the initial export)
is a CPU process unless its environment says otherwise. The model builder,
the trainer, its torchft Manager and the collectives take their device and
backends from here, so nothing else asks whether CUDA is present.
"""

from __future__ import annotations

import os

import torch

from elastic_rl import jobenv
from elastic_rl.errors import WrongDevice
from policies.devices import DeviceKind, ProcessDevice


def assigned() -> ProcessDevice:
    """The device erld gave this process: its kind, and on CUDA the GPUs it sees."""
    kind = DeviceKind(os.environ.get(jobenv.DEVICE_KIND) or DeviceKind.CPU.value)
    if kind is DeviceKind.CPU:
        return ProcessDevice(kind)
    slots = os.environ.get(jobenv.SLOTS, "")
    return ProcessDevice(kind, tuple(int(slot) for slot in slots.split(",") if slot.strip()))


def activate(device: ProcessDevice) -> torch.device:
    """Make ``device`` the one this process's tensors live on; return it as torch names it."""
    if device.kind is DeviceKind.CUDA:
        if not torch.cuda.is_available():
            where = f"erld gave this process GPU slot(s) {list(device.slots)}, but torch sees no CUDA device here"
            if torch.version.cuda is None:
                raise WrongDevice(
                    f"{where} (torch {torch.__version__} is built without CUDA); install a CUDA build of torch"
                )
            # A CUDA build that sees no GPU: a device or driver fault, which a restart or a spare may get past.
            raise RuntimeError(f"{where} (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
        torch.cuda.set_device(0)  # the first of the GPUs it sees, which are its slots
    return torch.device(device.torch_device)


def use_deterministic_algorithms(device: ProcessDevice) -> None:
    """Deterministic kernels: strictly on CPU, where runs are compared bit for bit; on CUDA a kernel
    with no deterministic variant warns instead of failing the step."""
    torch.use_deterministic_algorithms(True, warn_only=device.kind is DeviceKind.CUDA)
