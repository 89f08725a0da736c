"""Context parallelism (``trainer.context_parallel``): each of a replica's context-parallel ranks holds a
share of every sample, so a sequence longer than one device's activations can hold trains over several.

The layout is megatron's. Each sample of a packed micro-batch is padded at its end to a multiple of
2 x CP tokens and cut into 2 x CP equal chunks; rank r holds chunks r and 2 x CP - 1 - r (one from the
front and its mirror from the back, so that every rank has the same causal work), and its micro-batch
is its two chunks of each sample, end to end (``ModelInput.split_over_context``). The packed-sequence
parameters keep the whole samples' padded boundaries: megatron's rotary embedding gives each chunk its
true positions from them. With sequence parallelism a rank's share must split evenly over the
tensor-parallel ranks: a sample of padding alone, split like the others, makes it up.

- **Attention** (``model.attention``): a rank gathers every rank's keys and values (the backward pass
  sums their gradients back to the rank that holds them), lays each sample's out in order, and
  attends each of its query chunks to the keys up to that chunk's end, causally: the chunk's last row
  sees every key before it. Exact: what unsplit attention computes. The fused kernel's own causal mask
  is aligned to the first key, so a chunk takes an additive mask instead, held in memory linear in the
  keys: with the chunk's rows in reverse order, whether row i sees key j depends on i + j alone, so the
  ``[chunk, keys]`` mask is a strided view of one vector (a dense boolean mask would be turned into a
  float copy by every call and kept for each layer's backward pass). ``ContextSplit`` holds what every
  layer's attention of one micro-batch shares: where each chunk's rows and keys are, and the masks.
- **Scores**: a rank scores the positions it holds and spreads them into the micro-batch's
  ``[rows, width]`` layout, 0 elsewhere; ``ModelInput.spread`` adds the ranks' layouts, so every rank
  holds all the scores and computes the same loss. Its backward pass hands each rank that loss's
  gradient unchanged, so each rank's parameter gradients hold its own tokens' share, and the step sums
  them over the ranks (``trainer.grpo``).

Padding tokens come after each sample's real ones: no real token attends to them, and none is scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


def context_ranks() -> int:
    """The context-parallel ranks of this process's replica (1 without context parallelism, or before
    megatron's groups are set up)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


@dataclass(frozen=True)
class ChunkCall:
    """One fused attention call: a chunk of the samples of one padded length."""

    rows: torch.Tensor
    """The chunk's rows in this rank's packed sequence, ``[samples, chunk]``."""
    keys: torch.Tensor
    """The whole samples' positions up to the chunk's end, ``[samples, keys]``."""


@dataclass
class ContextSplit(PackedSeqParams):
    """megatron's packed-sequence parameters of a micro-batch split over the context-parallel ranks (the
    whole samples' padded boundaries), with what every layer's attention of it shares."""

    calls: list[ChunkCall] = field(default_factory=list)
    whole_order: torch.Tensor | None = None
    """For each position of the whole padded samples, where the rank-by-rank gather of keys holds it."""
    masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, call: ChunkCall, dtype: torch.dtype) -> torch.Tensor:
        """The additive ``[chunk, keys]`` mask of ``call``'s rows taken in reverse order (0 where a row sees
        a key, -inf elsewhere), in ``dtype``: one per chunk size and keys, shared by the layers."""
        chunk, keys = call.rows.shape[1], call.keys.shape[1]
        if (chunk, keys, dtype) not in self.masks:
            # Reversed row r is row chunk - 1 - r, which sees every key up to keys - 1 - r: those with r + j < keys.
            line = torch.full((keys + chunk - 1,), float("-inf"), dtype=dtype, device=call.rows.device)
            line[:keys] = 0.0
            self.masks[chunk, keys, dtype] = line.as_strided((chunk, keys), (1, 1))
        return self.masks[chunk, keys, dtype]


def context_split(bounds: torch.Tensor, local_tokens: int, device: torch.device) -> ContextSplit:
    """The parameters of a split micro-batch whose whole padded samples start at ``bounds`` (and the last
    ends there), this rank holding ``local_tokens`` of it."""
    group = parallel_state.get_context_parallel_group()
    rank, ranks = group.rank(), group.size()
    edges = bounds.tolist()
    longest = max(end - start for start, end in zip(edges, edges[1:]))
    cu_seqlens = bounds.to(device=device, dtype=torch.int32)
    return ContextSplit(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        calls=_chunk_calls(edges, rank, ranks, device),
        whole_order=_whole_order(edges, ranks, local_tokens).to(device),
    )


def whole_keys_and_values(
    key: torch.Tensor, value: torch.Tensor, split: ContextSplit
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's packed ``[tokens, heads, dim]`` keys and values, gathered and laid out as the whole
    padded samples are."""
    group = parallel_state.get_context_parallel_group()
    return tuple(
        gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True, group=group).index_select(
            0, split.whole_order
        )
        for tensor in (key, value)
    )


def _whole_order(bounds: list[int], ranks: int, local_tokens: int) -> torch.Tensor:
    pieces = 2 * ranks
    order = []
    for start, end in zip(bounds, bounds[1:]):
        chunk = (end - start) // pieces
        local_start = start // ranks
        for index in range(pieces):
            owner, second = (index, 0) if index < ranks else (pieces - 1 - index, 1)
            first = owner * local_tokens + local_start + second * chunk
            order.extend(range(first, first + chunk))
    return torch.tensor(order, dtype=torch.long)


def _chunk_calls(bounds: list[int], rank: int, ranks: int, device: torch.device) -> list[ChunkCall]:
    pieces = 2 * ranks
    starts: dict[int, list[int]] = {}
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            starts.setdefault(end - start, []).append(start)
    calls = []
    for length, first in starts.items():
        chunk = length // pieces
        whole = torch.tensor(first).unsqueeze(1)
        local = whole // ranks
        for half, index in enumerate((rank, pieces - 1 - rank)):
            rows = local + half * chunk + torch.arange(chunk)
            positions = whole + torch.arange((index + 1) * chunk)
            calls.append(ChunkCall(rows.to(device), positions.to(device)))
    return calls
