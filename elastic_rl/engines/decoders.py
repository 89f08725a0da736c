"""The cpu engine's forward passes over a KV cache (transformers' ``DynamicCache``).

A decoder keeps the KV cache of the sequences it has seen and, each step,
returns the next-token logits of some of them:

- ``BatchedDecoder``: continuous batching. Sequences that join are prefilled
  together (left-padded to a common length, with an attention mask hiding the
  padding), then merged into the running batch, whose cache is one left-padded
  tensor per layer; a decode step runs one forward over every running
  sequence. Sequences leave between steps (their cache rows are dropped, and
  padding columns no row needs any more are trimmed).
- ``InvariantDecoder``: deterministic inference, batched. Each sequence has
  its own cache and its own prefill and attention, and the decode step's
  matrix products run over every sequence at once with at least
  ``MIN_ROWS`` rows: at a fixed kernel choice a row's product does not depend
  on the other rows, so a sequence's tokens and log probabilities do not
  depend on what else is being served. That property of the machine's matrix
  library is checked when the decoder is made (``batch_invariant``).
- ``SoloDecoder``: deterministic inference where that check fails: each
  sequence its own forward passes, one at a time.

A sequence is its token ids so far (prompt and output); the last one, just
sampled, is not in the cache yet. Weights changing invalidates every cache
(``reset``): a sequence kept across an update is prefilled again on the new
weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

log = logging.getLogger("elastic_rl.engines.decoders")

# From 4 rows on, this machine's matrix library picks one kernel and gives every row the same
# bits whatever the other rows hold (1 to 3 rows take other kernels); checked by batch_invariant.
MIN_ROWS = 4


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
    def __init__(self, model: PreTrainedModel, pad_token_id: int):
        self.model = model
        self.pad = pad_token_id
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
        tokens, mask = _left_pad([s.token_ids() for s in joining], self.pad)
        cache = DynamicCache()
        logits = _forward(self.model, tokens, mask, _positions(mask), cache)
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
        return dict(zip(self.rows, logits))

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
    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.caches: dict[Tokens, DynamicCache] = {}

    def step(self, sequences: Sequence[Tokens]) -> dict[Tokens, torch.Tensor]:
        return {sequence: self._next(sequence) for sequence in sequences}

    def _next(self, sequence: Tokens) -> torch.Tensor:
        ids = sequence.token_ids()
        cache = self.caches.get(sequence)
        if cache is None:
            cache = self.caches[sequence] = DynamicCache()
            tokens = torch.tensor([ids])
            positions = torch.arange(len(ids)).unsqueeze(0)
        else:
            tokens = torch.tensor([[ids[-1]]])
            positions = torch.tensor([[len(ids) - 1]])
        return _forward(self.model, tokens, None, positions, cache)[0]

    def drop(self, sequences: Iterable[Tokens]) -> None:
        for sequence in sequences:
            self.caches.pop(sequence, None)

    def reset(self) -> None:
        self.caches.clear()


def batch_invariant(model: PreTrainedModel, max_rows: int) -> bool:
    """Whether each linear layer gives a row the same bits at MIN_ROWS rows and at ``max_rows``
    rows, wherever the row sits and whatever the others hold."""
    generator = torch.Generator().manual_seed(0)
    shapes = {m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)}
    rows = max(max_rows, MIN_ROWS + 1)
    with torch.inference_mode():
        for out_features, in_features in shapes:
            weight = torch.randn(out_features, in_features, generator=generator)
            inputs = torch.randn(rows, in_features, generator=generator)
            alone = F.linear(inputs[:MIN_ROWS], weight)[0]
            crowded = inputs.flip(0)
            if not torch.equal(F.linear(crowded, weight)[-1], alone):
                return False
    return True


class InvariantDecoder:
    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.core = model.model
        self.caches: dict[Tokens, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """Per sequence, per layer: keys and values [kv heads, length, head dim]."""

    def step(self, sequences: Sequence[Tokens]) -> dict[Tokens, torch.Tensor]:
        joining = [s for s in sequences if s not in self.caches]
        if joining:
            return {sequence: self._prefill(sequence) for sequence in joining}
        return self._decode(list(sequences))

    def _prefill(self, sequence: Tokens) -> torch.Tensor:
        ids = sequence.token_ids()
        cache = DynamicCache()
        logits = _forward(self.model, torch.tensor([ids]), None, torch.arange(len(ids)).unsqueeze(0), cache)
        self.caches[sequence] = [(k[0], v[0]) for k, v in _kv(cache)]
        return logits[0]

    def _decode(self, rows: list[Tokens]) -> dict[Tokens, torch.Tensor]:
        if not rows:
            return {}
        padding = max(0, MIN_ROWS - len(rows))
        last = torch.tensor([s.token_ids()[-1] for s in rows] + [0] * padding)
        positions = torch.tensor([len(s.token_ids()) - 1 for s in rows] + [0] * padding)
        hidden = self.core.embed_tokens(last)
        cos, sin = self.core.rotary_emb(hidden, positions)
        for index, layer in enumerate(self.core.layers):
            attention = self._attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, rows, index)
            hidden = hidden + attention
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = self.model.lm_head(self.core.norm(hidden)).float()
        return dict(zip(rows, logits))

    def _attention(self, attn, x: torch.Tensor, cos, sin, rows: list[Tokens], layer: int) -> torch.Tensor:
        """Self-attention of one new token per row: projections batched, attention per sequence."""
        count, head_dim = x.shape[0], attn.head_dim
        q = attn.q_proj(x).view(count, -1, head_dim)
        k = attn.k_proj(x).view(count, -1, head_dim)
        v = attn.v_proj(x).view(count, -1, head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        out = torch.zeros_like(q)
        for row, sequence in enumerate(rows):
            keys, values = self.caches[sequence][layer]
            keys = torch.cat([keys, k[row].unsqueeze(1)], dim=1)
            values = torch.cat([values, v[row].unsqueeze(1)], dim=1)
            self.caches[sequence][layer] = (keys, values)
            out[row] = F.scaled_dot_product_attention(
                q[row].unsqueeze(1), keys, values, scale=attn.scaling, enable_gqa=True
            ).squeeze(1)
        return attn.o_proj(out.view(count, -1))

    def drop(self, sequences: Iterable[Tokens]) -> None:
        for sequence in sequences:
            self.caches.pop(sequence, None)

    def reset(self) -> None:
        self.caches.clear()
