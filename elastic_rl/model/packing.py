"""A micro-batch as the model takes it: its samples padded to the longest one, or packed end to end.

The rollout holds each sample as a row of ``tokens``: its prompt, then its
response, right-padded to the rollout's width. The model scores response tokens:
each one's log prob given the tokens before it, read from the final hidden state
at the position before it.

- **Padded**: the micro-batch's rows cut to its longest sample, less the last
  column (no token follows it). Every position from the shortest prompt's last
  token on is scored; a causal model's real tokens never see the padding on
  their right.
- **Packed**: each sample, less its last token, laid end to end as one sequence
  of real tokens only (megatron's ``thd`` layout: ``[1, tokens]``, the samples'
  boundaries in ``PackedSeqParams``). Attention stays within each sample and the
  rotary positions restart at each. Only the positions before response tokens
  are scored.

A mixture of experts' routing to replay (``model.routing_replay``) is laid out
as the tokens are, ``[rows, seq, layers, topk]`` or ``[1, tokens, layers, topk]``.

A packed micro-batch may be split over context-parallel ranks (``split_over_context``; the layout is
``model.context_parallel``'s): each rank then holds its share of every sample.

Either way ``ModelInput.spread`` puts the scores of its positions back into the
micro-batch's ``[rows, width]`` layout, 0 where nothing was scored, so every
loss reads them as it reads a padded batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from elastic_rl.model.context_parallel import context_split
from elastic_rl.routing_record import NO_ROUTE


@dataclass(frozen=True)
class ModelInput:
    """One micro-batch as the model takes it, and where its scored positions go."""

    tokens: torch.Tensor
    """Padded ``[rows, seq]``; packed ``[1, tokens]``."""
    targets: torch.Tensor
    """``[rows, scored]`` padded, ``[1, scored]`` packed: the token each scored position predicts."""
    rows: int
    """The samples it holds (what ``spread`` lays the scores out over)."""
    first: int = 0
    """Padded: the first scored position; every one after it is scored too."""
    bounds: torch.Tensor | None = None
    """Packed: where each sample starts in the sequence, and where the last ends (``cu_seqlens``)."""
    positions: torch.Tensor | None = None
    """Packed: the scored positions of the sequence."""
    places: tuple[torch.Tensor, torch.Tensor] | None = None
    """Packed: the (row, column) of each scored token in the micro-batch's ``[rows, width]`` layout."""
    routing: torch.Tensor | None = None
    """The experts to route each token to, as ``tokens`` plus ``[layers, topk]`` (``NO_ROUTE``: the router's
    choice); None: every token routed by the router."""
    context_ranks: int = 1
    """Packed: the context-parallel ranks the samples are split over (``model.context_parallel``), each
    holding its share of every sample; ``bounds`` are then the whole samples', padded."""

    @property
    def packed(self) -> bool:
        return self.bounds is not None

    def seq_params(self, device: torch.device) -> PackedSeqParams | None:
        """megatron's description of a packed sequence (None when padded); split over context-parallel
        ranks, with what the layers' attention shares (``model.context_parallel``)."""
        if self.bounds is None:
            return None
        if self.context_ranks > 1:
            return context_split(self.bounds, self.tokens.shape[1], device)
        bounds = self.bounds.to(device=device, dtype=torch.int32)
        longest = int((self.bounds[1:] - self.bounds[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest, max_seqlen_kv=longest
        )

    def select(self, hidden: torch.Tensor) -> torch.Tensor:
        """The scored positions of the decoder's output ``[seq, batch, hidden]``."""
        if self.positions is None:
            return hidden[self.first :]
        return hidden.index_select(0, self.positions.to(hidden.device))

    def spread(self, scores: torch.Tensor, width: int) -> torch.Tensor:
        """``scores`` of the scored positions (``[batch, scored]``, as ``targets``) as ``[rows, width]``: each
        at its token's place, 0 elsewhere. Differentiable. Split over context-parallel ranks, every rank's
        scores: the ranks' layouts added, the gradient passed to each unchanged."""
        if self.places is None:
            return torch.cat([scores.new_zeros(self.rows, width - scores.shape[1]), scores], dim=1)
        rows, columns = (index.to(scores.device) for index in self.places)
        spread = scores.new_zeros(self.rows, width).index_put((rows, columns), scores[0])
        if self.context_ranks == 1:
            return spread
        return reduce_from_tensor_model_parallel_region(spread, group=parallel_state.get_context_parallel_group())

    def split_over_context(self, rank: int, ranks: int, multiple: int = 1) -> ModelInput:
        """Rank ``rank``'s share of this packed micro-batch split over ``ranks`` context-parallel ranks
        (``model.context_parallel``): each sample padded at its end to a multiple of 2 x ``ranks`` and cut
        into that many chunks, of which the rank holds chunks ``rank`` and 2 x ``ranks`` - 1 - ``rank``, end
        to end; the scored positions among them; the whole samples' padded boundaries. A rank's share is a
        multiple of ``multiple`` tokens (sequence parallelism splits it over the tensor-parallel ranks):
        where the samples' chunks fall short, a sample of padding alone makes up the rest."""
        if not self.packed:
            raise ValueError("context parallelism splits packed micro-batches only")
        starts, ends = self.bounds[:-1].cpu(), self.bounds[1:].cpu()
        pieces = 2 * ranks
        padded = -(-(ends - starts) // pieces) * pieces  # each sample's length, padded
        chunk = padded // pieces
        # A rank holds two chunks of each sample, an even count: so is what it lacks of a multiple of
        # lcm(2, multiple), and a padding sample of 2 x ranks chunks gives it that many (two chunks a rank).
        short = -int(2 * chunk.sum()) % math.lcm(2, multiple)
        if short:
            starts, ends = torch.cat([starts, ends[-1:]]), torch.cat([ends, ends[-1:]])
            padded, chunk = (
                torch.cat([padded, padded.new_tensor([ranks * short])]),
                torch.cat([chunk, chunk.new_tensor([short // 2])]),
            )
        # Every local slot, sample by sample: its sample, and its index among the sample's 2 x chunk slots.
        sample = torch.repeat_interleave(torch.arange(len(chunk)), 2 * chunk)
        index = torch.arange(len(sample)) - (torch.cumsum(2 * chunk, 0) - 2 * chunk)[sample]
        size = chunk[sample]
        offset = torch.where(index < size, rank * size + index, (pieces - 1 - rank) * size + index - size)
        held = starts[sample] + offset
        real = held < ends[sample]  # the rest pads the sample to a whole number of chunks
        tokens = self.tokens.new_zeros(1, len(held))
        tokens[0, real.to(tokens.device)] = self.tokens[0, held[real].to(tokens.device)]
        slot_of = torch.full((self.tokens.shape[1],), -1, dtype=torch.long)
        slot_of[held[real]] = torch.arange(len(held))[real]
        local = slot_of[self.positions.cpu()]
        kept = torch.nonzero(local >= 0).flatten()
        rows, columns = self.places
        return replace(
            self,
            tokens=tokens,
            targets=self.targets[:, kept.to(self.targets.device)],
            bounds=torch.cat([padded.new_zeros(1), torch.cumsum(padded, 0)]),
            positions=local[kept],
            places=(rows[kept], columns[kept]),
            context_ranks=ranks,
        )

    def padded_to(self, rows: int, seq: int) -> ModelInput:
        """The same micro-batch with ``tokens`` grown to ``[rows, seq]`` (the shape the expert-parallel ranks
        agreed on; packed, ``rows`` is 1 and the added tokens are a sample of their own). Scores the same
        positions."""
        more_rows, more_seq = rows - self.tokens.shape[0], seq - self.tokens.shape[1]
        if self.context_ranks > 1 and more_seq:
            # Its bounds are the whole samples': split_over_context makes a rank's share the length it needs.
            raise ValueError("a micro-batch split over context-parallel ranks is not padded after the split")
        tokens = torch.nn.functional.pad(self.tokens, (0, more_seq, 0, more_rows))
        routing = self.routing
        if routing is not None:
            routing = torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, more_seq, 0, more_rows), value=NO_ROUTE)
        if not self.packed or more_seq == 0:
            return replace(self, tokens=tokens, routing=routing)
        bounds = torch.cat([self.bounds, self.bounds.new_tensor([seq])])
        return replace(self, tokens=tokens, routing=routing, bounds=bounds)


def empty_input(rows: int, seq: int, packed: bool) -> ModelInput:
    """A micro-batch of padding only, of the agreed shape, that scores one position (an expert-parallel rank
    with fewer micro-batches than its peers runs it so that the dispatcher's collectives meet)."""
    tokens = torch.zeros(rows, seq, dtype=torch.long)
    targets = torch.zeros(rows, 1, dtype=torch.long)
    if not packed:
        return ModelInput(tokens, targets, rows=0, first=seq - 1)
    bounds = torch.tensor([0, seq])
    return ModelInput(tokens, targets[:1], rows=0, bounds=bounds, positions=torch.tensor([seq - 1]))


def padded_input(
    tokens: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, routing: torch.Tensor | None = None
) -> ModelInput:
    """The rows of ``tokens`` (a micro-batch's samples, ``lengths`` long each, the first ``prompt_lengths``
    of them their prompts) padded to the longest sample; ``routing``, if given, laid out alike."""
    width, first = int(lengths.max()), int(prompt_lengths.min())
    return ModelInput(
        tokens[:, : width - 1],
        tokens[:, first:width],
        rows=tokens.shape[0],
        first=first - 1,
        routing=None if routing is None else routing[:, : width - 1],
    )


def packed_input(
    tokens: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, routing: torch.Tensor | None = None
) -> ModelInput:
    """The rows of ``tokens`` packed end to end, each less its last token: what ``padded_input`` scores, with
    no padding; ``routing``, if given, laid out alike."""
    columns = torch.arange(tokens.shape[1])
    kept = (columns.unsqueeze(0) < (lengths - 1).unsqueeze(1)).to(tokens.device)  # each row less its last token
    inputs = (lengths - 1).clamp(min=0)
    starts = inputs.cumsum(0) - inputs
    responses = (columns.unsqueeze(0) >= prompt_lengths.unsqueeze(1)) & (columns.unsqueeze(0) < lengths.unsqueeze(1))
    rows, places = responses.nonzero(as_tuple=True)  # row by row, as the pack lays the samples out
    return ModelInput(
        tokens[kept].unsqueeze(0),
        tokens[rows.to(tokens.device), places.to(tokens.device)].unsqueeze(0),
        rows=tokens.shape[0],
        bounds=torch.cat([starts, inputs.sum().unsqueeze(0)]),
        positions=starts[rows] + places - 1,
        places=(rows, places),
        routing=None if routing is None else routing[kept.to(routing.device)].unsqueeze(0),
    )
