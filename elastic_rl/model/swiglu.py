"""The policy's MLP activation, SwiGLU, kept as megatron's fused form keeps it, computed eagerly.

megatron's MLP without ``bias_activation_fusion`` keeps four MLP-wide tensors a
token for its backward pass (the gate and up halves, the gate's SiLU, and the up
half plus a zero offset); with it, its ``SwiGLUFunction`` keeps only the input
and computes the SiLU again in the backward pass. megatron compiles that
function's two halves with ``torch.compile``, which would compile C++ at every
trainer's start on a CPU slot. ``use_eager_swiglu`` gives megatron's function the
same two halves as plain torch operations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.fusions import fused_bias_swiglu


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of ``y``'s last dimension times its second half."""
    gate, up = torch.chunk(y, 2, -1)
    return F.silu(gate) * up


def swiglu_back(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of ``swiglu`` at ``y``, given the gradient of its output."""
    gate, up = torch.chunk(y, 2, -1)
    return torch.cat((torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)), -1)


def use_eager_swiglu() -> None:
    """megatron's SwiGLUFunction computes with ``swiglu`` and ``swiglu_back`` from here on."""
    fused_bias_swiglu.swiglu = swiglu
    fused_bias_swiglu.swiglu_back = swiglu_back
