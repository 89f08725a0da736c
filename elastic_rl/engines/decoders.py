"""The cpu engine's forward passes over a KV cache (transformers' ``DynamicCache``).

A decoder keeps the KV cache of the sequences it has seen and, each step,
returns the next-token logits of some of them:

- ``BatchedDecoder``: continuous batching. Sequences that join are prefilled
  together (left-padded to a common length, with an attention mask hiding the
  padding; sequences that join with the same tokens, a prompt's samples, are
  prefilled once), then merged into the running batch, whose cache is one
  left-padded tensor per layer; a decode step runs one forward over every
  running sequence. Sequences leave between steps (their cache rows are
  dropped, and padding columns no row needs any more are trimmed).
- ``InvariantDecoder``: deterministic inference, batched. Every token is a
  row: each sequence has its own cache and attention, and the matrix
  products run over the step's rows at once, at least a floor's worth of
  rows: past that floor a row's product does not depend on the other rows,
  so a sequence's tokens and log probabilities do not depend on what else is
  being served, nor on whether its prefix was prefilled or decoded. The floor
  is found when the decoder is made (``invariant_floor``).
- ``SoloDecoder``: deterministic inference where that check fails, or for
  a mixture of experts (an expert multiplies only the rows routed to it, so
  the floor cannot hold): each sequence its own forward passes, one token at
  a time.

A sequence is its token ids so far (prompt and output); the last one, just
sampled, is not in the cache yet. Weights changing invalidates every cache
(``reset``): a sequence kept across an update is prefilled again on the new
weights.

A decoder given a ``RouterTrace`` (a mixture of experts) also keeps, for each
sequence, the rows its forward passes routed (``take_routing``): the rows of
its routing record from the first position the pass took.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from elastic_rl.engines.router_trace import RouterTrace

log = logging.getLogger("elastic_rl.engines.decoders")

# The row counts tried as the floor of a deterministic step (``invariant_floor``), fewest first.
FLOOR_CANDIDATES = (4, 8, 16, 32)


class Tokens(Protocol):
    """What a decoder needs of a request: its token ids so far."""

    def token_ids(self) -> list[int]: ...


class Decoder(Protocol):
    def step(self, sequences: Sequence[Tokens]) -> dict[Tokens, torch.Tensor]:
        """Next-token logits (float32 [vocab]) of the sequences that had a forward this step."""

    def drop(self, sequences: Iterable[Tokens]) -> None:
        """Forget sequences that finished or were aborted (unknown ones are ignored)."""

    def reset(self) -> None:
        """Forget every cache (the weights changed)."""

    def take_routing(self) -> dict[Tokens, tuple[int, torch.Tensor]]:
        """Per sequence that had a forward since the last call: (its first position the forward took, the
        experts each of its tokens from there was routed to ``[tokens, layers, topk]``); empty for a dense
        model."""


def _forward(model: PreTrainedModel, tokens, mask, positions, cache: DynamicCache) -> torch.Tensor:
    output = model(
        input_ids=tokens,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return output.logits[:, -1].float()


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids [n, L] and their attention mask (1 on real tokens)."""
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        tokens[index, width - len(row) :] = torch.tensor(row)
        mask[index, width - len(row) :] = 1
    return tokens, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Each real token's position in its own sequence (padding gets 0)."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


class BatchedDecoder:
    def __init__(self, model: PreTrainedModel, pad_token_id: int, trace: RouterTrace | None = None):
        self.model = model
        self.pad = pad_token_id
        self.trace = trace
        self.routed: dict[Tokens, tuple[int, torch.Tensor]] = {}
        self.rows: list[Tokens] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)

    def step(self, sequences: Sequence[Tokens]) -> dict[Tokens, torch.Tensor]:
        known = set(self.rows)
        joining = [s for s in sequences if s not in known]
        if joining:
            return self._prefill(joining)
        return self._decode()

    def _prefill(self, joining: list[Tokens]) -> dict[Tokens, torch.Tensor]:
        # The samples of one prompt join with the same tokens: each distinct sequence is prefilled once
        # and its cache rows are copied to the others (SGLang shares a common prefix through its radix
        # cache). On the SmolLM2 job, 8 samples a prompt, a rollout's generation took 8.5 s instead of 10 s.
        distinct: dict[tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(s.token_ids()), len(distinct)) for s in joining]
        tokens, mask = _left_pad([list(ids) for ids in distinct], self.pad)
        cache = DynamicCache()
        logits = _forward(self.model, tokens, mask, _positions(mask), cache)
        if self.trace is not None:
            chosen = self.trace.take(*tokens.shape)
            for sequence, row in zip(joining, source):
                real = int(mask[row].sum())  # left-padded: the real tokens are the last ones
                self.routed[sequence] = (0, chosen[row, tokens.shape[1] - real :])
        if len(distinct) < len(joining):
            rows = torch.tensor(source)
            cache = DynamicCache(ddp_cache_data=[(k[rows], v[rows]) for k, v in _kv(cache)])
            mask, logits = mask[rows], logits[rows]
        self._merge(joining, cache, mask)
        return dict(zip(joining, logits))

    def _merge(self, joining: list[Tokens], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append the prefilled sequences to the running batch, left-padding both to one length."""
        if self.cache is None:
            self.rows, self.cache, self.mask = list(joining), cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])

        def pad(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - tensor.shape[dim]
            if missing == 0:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = missing
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        merged = [
            (torch.cat([pad(k0, 2), pad(k1, 2)]), torch.cat([pad(v0, 2), pad(v1, 2)]))
            for (k0, v0), (k1, v1) in zip(_kv(self.cache), _kv(cache))
        ]
        self.cache = DynamicCache(ddp_cache_data=merged)
        self.mask = torch.cat([pad(self.mask, 1), pad(mask, 1)])
        self.rows += joining

    def _decode(self) -> dict[Tokens, torch.Tensor]:
        if not self.rows:
            return {}
        last = torch.tensor([[s.token_ids()[-1]] for s in self.rows])
        self.mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=torch.long)], dim=1)
        positions = self.mask.sum(dim=1, keepdim=True) - 1
        logits = _forward(self.model, last, self.mask, positions, self.cache)
        if self.trace is not None:
            chosen = self.trace.take(len(self.rows), 1)
            for index, sequence in enumerate(self.rows):
                self.routed[sequence] = (len(sequence.token_ids()) - 1, chosen[index])
        return dict(zip(self.rows, logits))

    def take_routing(self) -> dict[Tokens, tuple[int, torch.Tensor]]:
        routed, self.routed = self.routed, {}
        return routed

    def drop(self, sequences: Iterable[Tokens]) -> None:
        leaving = set(sequences)
        keep = [index for index, row in enumerate(self.rows) if row not in leaving]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[index] for index in keep]
        if not self.rows:
            self.reset()
            return
        self.mask = self.mask[keep]
        # Columns that are padding in every remaining row are dead weight.
        first = int((self.mask.sum(dim=0) > 0).nonzero()[0])
        self.mask = self.mask[:, first:]
        self.cache = DynamicCache(ddp_cache_data=[(k[keep, :, first:], v[keep, :, first:]) for k, v in _kv(self.cache)])

    def reset(self) -> None:
        self.rows, self.cache = [], None
        self.mask = torch.zeros((0, 0), dtype=torch.long)


class SoloDecoder:
    def __init__(self, model: PreTrainedModel, trace: RouterTrace | None = None):
        self.model = model
        self.trace = trace
        self.caches: dict[Tokens, DynamicCache] = {}
        self.routed: dict[Tokens, tuple[int, torch.Tensor]] = {}

    def step(self, sequences: Sequence[Tokens]) -> dict[Tokens, torch.Tensor]:
        return {sequence: self._next(sequence) for sequence in sequences}

    def _next(self, sequence: Tokens) -> torch.Tensor:
        """One forward per token not yet in the cache, a prompt's too: a prefix is computed as its
        decode steps were, so a continuation gets the bits the uninterrupted request had."""
        ids = sequence.token_ids()
        cache = self.caches.setdefault(sequence, DynamicCache())
        start, rows = cache.get_seq_length(), []
        for position in range(start, len(ids)):
            tokens = torch.tensor([[ids[position]]])
            logits = _forward(self.model, tokens, None, torch.tensor([[position]]), cache)
            if self.trace is not None:
                rows.append(self.trace.take(1, 1)[0])
        if rows:
            self.routed[sequence] = (start, torch.cat(rows))
        return logits[0]

    def take_routing(self) -> dict[Tokens, tuple[int, torch.Tensor]]:
        routed, self.routed = self.routed, {}
        return routed

    def drop(self, sequences: Iterable[Tokens]) -> None:
        for sequence in sequences:
            self.caches.pop(sequence, None)

    def reset(self) -> None:
        self.caches.clear()


def invariant_floor(model: PreTrainedModel, max_rows: int) -> int | None:
    """The fewest rows from which every linear layer gives a row the same bits at any row count up to
    ``max_rows``, wherever the row sits and whatever the others hold; None if no candidate has that.

    A matrix library picks its kernel by the row count: on an x86_64 CPU with torch's default BLAS, 1 row, 2 to 15
    and 16 on up are three kernels for SmolLM2's shapes (for a 128-wide input, 2 to 5 and 6 on up). Counts within a
    kernel's range agree bit for bit; a step padded to the floor stays in the last range.
    """
    generator = torch.Generator().manual_seed(0)
    shapes = sorted({m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)})
    weights = [torch.randn(out_features, in_features, generator=generator) for out_features, in_features in shapes]
    with torch.inference_mode():
        for floor in FLOOR_CANDIDATES:
            most = max(max_rows, floor)
            counts = sorted({count for count in (floor, floor + 1, 2 * floor, 3 * floor + 1, most) if count <= most})
            if all(_rows_agree(weight, counts, generator) for weight in weights):
                return floor
    return None


def _rows_agree(weight: torch.Tensor, counts: list[int], generator: torch.Generator) -> bool:
    """Whether one row's product has the same bits first among ``counts[0]`` rows and last among each count."""
    inputs = torch.randn(counts[0] + counts[-1], weight.shape[1], generator=generator)
    alone = F.linear(inputs[: counts[0]], weight)[0]
    return all(
        torch.equal(F.linear(torch.cat([inputs[counts[0] : counts[0] + count - 1], inputs[:1]]), weight)[-1], alone)
        for count in counts
    )


class _LayerCache:
    """One sequence's keys and values in one layer, position-major ([capacity, kv heads, head dim]) so that
    the first n positions are one contiguous block whatever the capacity."""

    def __init__(self, like: torch.Tensor):
        self.keys = like.new_empty((16, *like.shape))
        self.values = like.new_empty((16, *like.shape))
        self.length = 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.length == self.keys.shape[0]:
            self.keys = torch.cat([self.keys, torch.empty_like(self.keys)])
            self.values = torch.cat([self.values, torch.empty_like(self.values)])
        self.keys[self.length] = key
        self.values[self.length] = value
        self.length += 1

    def window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values so far as attention takes them: [kv heads, length, head dim]."""
        return self.keys[: self.length].transpose(0, 1), self.values[: self.length].transpose(0, 1)


class InvariantDecoder:
    """Every token, a prompt's as well as a generated one, is a row of the same computation: the
    projections and the MLP batched over the step's rows (between ``floor`` and ``max_rows`` of them,
    where ``invariant_floor`` showed a row's bits do not depend on the others), attention one row at a
    time over its own sequence's cache. A prefix prefilled on one engine so gives the bits its decode
    steps gave on another: a request continued from its tokens so far goes on exactly as it would have."""

    def __init__(self, model: PreTrainedModel, floor: int, max_rows: int):
        self.model = model
        self.core = model.model
        self.floor = floor
        self.max_rows = max(max_rows, floor)
        self.caches: dict[Tokens, list[_LayerCache]] = {}

    def step(self, sequences: Sequence[Tokens]) -> dict[Tokens, torch.Tensor]:
        rows: list[tuple[Tokens, int, int]] = []  # (sequence, position, token id): what is not cached yet
        for sequence in sequences:
            ids = sequence.token_ids()
            cached = self.caches[sequence][0].length if sequence in self.caches else 0
            rows += [(sequence, position, ids[position]) for position in range(cached, len(ids))]
        logits: dict[Tokens, torch.Tensor] = {}
        for start in range(0, len(rows), self.max_rows):
            logits.update(self._forward(rows[start : start + self.max_rows]))
        return logits

    def _forward(self, rows: list[tuple[Tokens, int, int]]) -> dict[Tokens, torch.Tensor]:
        """The rows through every layer, in order; the logits after each sequence's last row."""
        padding = max(0, self.floor - len(rows))
        tokens = torch.tensor([token for _, _, token in rows] + [0] * padding)
        positions = torch.tensor([position for _, position, _ in rows] + [0] * padding)
        hidden = self.core.embed_tokens(tokens)
        # As a batch of one sequence: some transformers releases (5.17) index position ids as [batch, positions].
        cos, sin = (part[0] for part in self.core.rotary_emb(hidden, positions.unsqueeze(0)))
        for index, layer in enumerate(self.core.layers):
            attention = self._attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, rows, index)
            hidden = hidden + attention
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = {sequence: row for row, (sequence, _, _) in enumerate(rows)}  # a sequence's rows are in order
        picked = list(last.values())
        picked += [picked[0]] * max(0, self.floor - len(picked))
        logits = self.model.lm_head(self.core.norm(hidden[picked])).float()
        return dict(zip(last, logits))

    def _attention(self, attn, x: torch.Tensor, cos, sin, rows: list[tuple[Tokens, int, int]], layer: int):
        """Self-attention of the rows: projections batched, attention one row at a time over the keys and
        values of its sequence up to its position."""
        count, head_dim = x.shape[0], attn.head_dim
        q = attn.q_proj(x).view(count, -1, head_dim)
        k = attn.k_proj(x).view(count, -1, head_dim)
        v = attn.v_proj(x).view(count, -1, head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        out = torch.zeros_like(q)
        for row, (sequence, _, _) in enumerate(rows):
            if sequence not in self.caches:
                self.caches[sequence] = [_LayerCache(k[row]) for _ in self.core.layers]
            cache = self.caches[sequence][layer]
            cache.append(k[row], v[row])
            keys, values = cache.window()
            out[row] = F.scaled_dot_product_attention(
                q[row].unsqueeze(1), keys, values, scale=attn.scaling, enable_gqa=True
            ).squeeze(1)
        return attn.o_proj(out.view(count, -1))

    def drop(self, sequences: Iterable[Tokens]) -> None:
        for sequence in sequences:
            self.caches.pop(sequence, None)

    def reset(self) -> None:
        self.caches.clear()

    def take_routing(self) -> dict[Tokens, tuple[int, torch.Tensor]]:
        return {}  # a dense model's only: a mixture of experts decodes with SoloDecoder
