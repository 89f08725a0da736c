"""A model's gradients held in one flat buffer: each trained parameter's ``.grad`` a view of its slice.

The backward pass accumulates straight into the buffer, and the step all-reduces it whole, so nothing is
copied in or out. The views hold only while the buffer does: a buffer moved to another device (colocated
mode's handover, ``trainer.offload``) is viewed again.
"""

from __future__ import annotations

import torch


def view_gradients(parameters: list[torch.nn.Parameter], buffer: torch.Tensor) -> int:
    """Point each parameter's ``.grad`` at its slice of ``buffer``, in order, from the start; returns the
    elements they take."""
    offset = 0
    for param in parameters:
        param.grad = buffer[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    return offset
