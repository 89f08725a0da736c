"""The policy's RMSNorms, as megatron's own torch norm builds them, and under sequence parallelism too.

megatron's ``WrappedTorchNorm`` (its norm without Transformer Engine or apex)
is torch's ``RMSNorm``, and refuses sequence parallelism: under it a norm
sees only this rank's slice of the sequence, so its weight's gradient is this
rank's share. ``RMSNorm`` is the same module without the refusal;
``SequenceSliceRMSNorm`` also marks its weight ``sequence_parallel``, as
megatron marks every parameter whose gradient is summed over the
tensor-parallel ranks under sequence parallelism (its routers' too; the
trainer sums them, ``layer_names.is_summed_over_tensor_ranks``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


class RMSNorm:
    """torch's RMSNorm, built from megatron's norm arguments (a norm that sees every position: q/k norms)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.RMSNorm:
        return torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)


class SequenceSliceRMSNorm:
    """torch's RMSNorm over the hidden states, which sequence parallelism slices along the sequence."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.RMSNorm:
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm
