"""This node's GPUs as `erl daemon --gpus` offers them: counted through NVML (nvidia-ml-py).

``--gpus all`` offers every GPU NVML sees, ``--gpus N`` the first N. Slot i is
NVML's GPU i; erld starts every GPU process with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
so that CUDA numbers them the same way. Counting needs NVIDIA's driver, not
CUDA or torch.
"""

from __future__ import annotations

import pynvml

from elastic_rl.errors import InputError


def gpu_slots(request: str) -> int:
    """The number of GPU slots ``--gpus REQUEST`` gives this node."""
    return slots_for(request, nvml_gpu_count())


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
        raise InputError(f"--gpus {wanted}: this node has {found} GPU(s) (NVML); ask for at most {found}, or `all`")
    return wanted


def nvml_gpu_count() -> int:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise InputError(
            f"--gpus: NVML cannot count this node's GPUs ({exc}); is NVIDIA's driver installed? "
            "On a CPU node use --cpu-devices N"
        ) from None
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
