"""The policy's core attention: causal attention through torch's fused ``scaled_dot_product_attention``.

megatron's local layer spec computes attention with ``DotProductAttention``: it
materialises the ``[heads, seq, seq]`` scores and keeps the probabilities for the
backward pass, so memory grows with the square of the sequence. ``FusedAttention``
takes its place in the layer spec (``layer_spec``) and hands the query, key and
value to torch's kernel instead: flash, memory-efficient or cuDNN attention on
CUDA, the fused kernel on the CPU. It is causal by construction; no mask is built
or passed. Grouped-query attention goes to the kernel as it is (``enable_gqa``),
without repeating the keys and values.

A micro-batch is either padded (``[seq, batch, heads, dim]``, samples padded on the
right: a causal model's real tokens never see the padding) or packed: megatron's
``thd`` layout, the samples laid end to end as one sequence (``[tokens, heads,
dim]``) and their boundaries in ``PackedSeqParams.cu_seqlens_q``. Packed, each
sample attends only within itself: the samples of one length are gathered into a
batch and take one fused call, exact and with no padding (a rollout of short
samples has few lengths; a long one's many samples are worth a call each), which
keeps the CPU kernel and its deterministic backward; megatron's rotary embedding
restarts the positions at each sample. Split over context-parallel ranks
(``model.context_parallel``), a rank's chunks of each sample attend to the whole
sample's keys gathered from every rank.

``Attention.LOCAL`` (``trainer.attention: local``) keeps megatron's own
``DotProductAttention``: the reference the fused path is checked against, for
padded micro-batches only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from elastic_rl.model.context_parallel import ContextSplit, whole_keys_and_values
from elastic_rl.model.norm import RMSNorm, SequenceSliceRMSNorm
from elastic_rl.spec.trainer import Attention


def layer_spec(attention: Attention, num_experts: int | None, qk_layernorm: bool) -> ModuleSpec:
    """megatron's local layer spec (RMSNorm, its own linear layers and MLP or experts), with the core
    attention ``attention`` names and norms that also work under sequence parallelism (``model.norm``)."""
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=qk_layernorm
    )
    attention_parts = spec.submodules.self_attention.submodules
    if attention is Attention.SDPA:
        attention_parts.core_attention = FusedAttention
    spec.submodules.input_layernorm = SequenceSliceRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceSliceRMSNorm
    if qk_layernorm:
        attention_parts.q_layernorm = attention_parts.k_layernorm = RMSNorm
    return spec


def block_spec(layer: ModuleSpec, config: TransformerConfig) -> TransformerBlockSubmodules:
    """The decoder of this rank's stage: ``layer`` for each of its layers, then the final norm."""
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=SequenceSliceRMSNorm
    )


class FusedAttention(MegatronModule):
    """megatron's core attention (the signature of ``DotProductAttention``) by one fused kernel call per
    padded micro-batch, or per sample of a packed one. This rank's heads only: tensor parallelism splits
    the heads and their query groups evenly."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.apply_query_key_layer_scaling:
            raise ValueError("FusedAttention does not scale the scores by the layer number")
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.grouped = config.num_query_groups != config.num_attention_heads

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Padded: ``[seq, batch, heads, dim]`` in, ``[seq, batch, heads * dim]`` out. Packed (``thd``):
        ``[tokens, heads, dim]`` in, ``[tokens, heads * dim]`` out. ``attention_mask`` is ignored: the
        attention is causal (within each sample, packed)."""
        if attention_bias is not None:
            raise ValueError("FusedAttention takes no attention bias")
        if self.config.context_parallel_size > 1 and not isinstance(packed_seq_params, ContextSplit):
            # Each rank holds only its chunks: attending over them alone would be silently wrong.
            raise ValueError(
                "context parallelism attends over packed micro-batches split by ModelInput.split_over_context"
            )
        if packed_seq_params is None:
            # [seq, batch, heads, dim] -> [batch, heads, seq, dim], the kernel's layout.
            out = self._attend(*(t.permute(1, 2, 0, 3) for t in (query, key, value)))
            return out.permute(2, 0, 1, 3).flatten(2)
        if self.config.context_parallel_size > 1:
            return self._attend_over_context_ranks(query, key, value, packed_seq_params)
        out = query.new_empty(query.shape)
        for positions in _samples_by_length(packed_seq_params.cu_seqlens_q.tolist(), query.device):
            # The samples of one length: [samples, length] positions -> [samples, heads, length, dim].
            attended = self._attend(*(t[positions].transpose(1, 2) for t in (query, key, value)))
            out = out.index_put((positions,), attended.transpose(1, 2))
        return out.flatten(1)

    def _attend_over_context_ranks(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, split: ContextSplit
    ) -> torch.Tensor:
        """This rank's two chunks of each sample (``model.context_parallel``), each attending to the whole
        sample's keys up to its end: one call per chunk and padded sample length."""
        keys, values = whole_keys_and_values(key, value, split)
        out = query.new_empty(query.shape)
        for call in split.calls:
            rows = call.rows.flip(1)  # the chunk's rows in reverse order, as its mask takes them
            attended = F.scaled_dot_product_attention(
                query[rows].transpose(1, 2),
                keys[call.keys].transpose(1, 2),
                values[call.keys].transpose(1, 2),
                attn_mask=split.mask(call, query.dtype),
                scale=self.scale,
                enable_gqa=self.grouped,
            )
            out = out.index_put((rows,), attended.transpose(1, 2))
        return out.flatten(1)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.scale, enable_gqa=self.grouped
        )


def _samples_by_length(bounds: list[int], device: torch.device) -> list[torch.Tensor]:
    """The positions of each packed sample (``bounds``: where each starts, and where the last ends), the
    samples of one length together: ``[samples, length]`` for each length."""
    starts: dict[int, list[int]] = {}
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            starts.setdefault(end - start, []).append(start)
    return [
        torch.tensor(first, device=device).unsqueeze(1) + torch.arange(length, device=device)
        for length, first in starts.items()
    ]
