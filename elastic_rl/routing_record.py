"""The experts a mixture of experts routed each token to: what an engine returns, what a sample carries
through persistence and the rollout log, and what the trainer replays (``algorithm.routing_replay``).

A routing record has a row for each token the engine ran through the model:
the prompt's tokens in its prefill, then each generated token but the last
(no forward has taken it yet; it only follows the last logits). A row holds,
for every MoE layer in order, the top-k expert indices the router chose, in
the order it ranked them: ``[tokens, layers, topk]``. After ``n`` generated
tokens of a ``p``-token prompt a record holds ``p + n - 1`` rows.

On the wire it is SGLang's ``meta_info["routed_experts"]``, which a request
asks for with ``return_routed_experts``: the rows as int32, base64-encoded.
Every chunk of a stream holds every row so far. A request continued from a
prefix (another engine took over a broken stream) gets rows for its whole
input again; the sample keeps its prefix's rows and takes only the rows
beyond them (``continued``), so a token keeps the routing that produced it.

In memory and in JSON (the group buffer, the in-flight log) a record is int16;
in the rollout batch it is ``[samples, width, layers, topk]`` in the smallest
integer type that holds every expert index and a mark for "no row" (the last
token, padding, a sample without a record): uint8 below 255 experts, else int16.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from elastic_rl.architecture import Architecture

WIRE_KEY = "routed_experts"
"""SGLang's meta_info field for the routing record."""
REQUEST_FLAG = "return_routed_experts"
"""What a /generate request sets to be given it."""
MEMORY_DTYPE = torch.int16
NO_ROUTE = -1
"""Where a replayed batch (``replayable``) holds no row: the trainer's router chooses for itself."""


@dataclass(frozen=True)
class RoutingShape:
    """A row's shape: the model's MoE layers and experts per token; and how many experts there are."""

    layers: int
    per_token: int
    experts: int

    @classmethod
    def of(cls, arch: Architecture) -> RoutingShape:
        """The records of ``arch``, a mixture of experts whose every layer routes."""
        return cls(arch.num_layers, arch.experts.per_token, arch.experts.count)

    @property
    def stored_dtype(self) -> torch.dtype:
        """The rollout batch's dtype: uint8 leaves 255 for "no row" while indices stay below it."""
        return torch.uint8 if self.experts < 255 else torch.int16

    @property
    def stored_blank(self) -> int:
        return 255 if self.stored_dtype is torch.uint8 else NO_ROUTE


def encode_wire(rows: torch.Tensor) -> str:
    """A record ``[tokens, layers, topk]`` as SGLang sends it."""
    return base64.b64encode(rows.to(torch.int32).contiguous().numpy().tobytes()).decode()


def decode_wire(text: str, shape: RoutingShape) -> torch.Tensor:
    """SGLang's ``routed_experts`` as an int16 record; ValueError when it is not whole rows of ``shape``, or
    names an expert the model does not have. -1, SGLang's mark for a slot no expert filled, stays: it is
    ``NO_ROUTE``."""
    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    row = shape.layers * shape.per_token
    if flat.size % row:
        raise ValueError(f"{WIRE_KEY} holds {flat.size} indices, not whole rows of {shape.layers} x {shape.per_token}")
    if flat.size and not (NO_ROUTE <= flat.min() and flat.max() < shape.experts):
        raise ValueError(f"{WIRE_KEY} names experts outside [0, {shape.experts})")
    return torch.from_numpy(flat.astype(np.int16)).view(-1, shape.layers, shape.per_token)


def continued(prefix: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """A sample's record once a request continued it: the prefix's rows, then the request's beyond them
    (the request's input was the prefix's tokens, so its rows start at the same token). Either alone
    when the other is missing."""
    if rows is None:
        return prefix
    if prefix is None:
        return rows
    return torch.cat([prefix, rows[len(prefix) :]])


def to_json(rows: torch.Tensor) -> dict[str, Any]:
    return {
        "rows": base64.b64encode(rows.to(MEMORY_DTYPE).contiguous().numpy().tobytes()).decode(),
        "shape": list(rows.shape),
    }


def from_json(data: dict[str, Any]) -> torch.Tensor:
    flat = np.frombuffer(base64.b64decode(data["rows"]), dtype=np.int16).copy()
    return torch.from_numpy(flat).view(*data["shape"])


def stored(records: list[torch.Tensor | None], width: int, shape: RoutingShape) -> torch.Tensor:
    """The rollout batch's ``[samples, width, layers, topk]``: each record from the sample's first token,
    the blank mark wherever a sample has no row."""
    batch = torch.full(
        (len(records), width, shape.layers, shape.per_token), shape.stored_blank, dtype=shape.stored_dtype
    )
    for index, rows in enumerate(records):
        if rows is not None:
            kept = rows[:width]
            batch[index, : len(kept)] = kept.to(shape.stored_dtype)
    return batch


def replayable(batch: torch.Tensor) -> torch.Tensor:
    """A stored batch as the trainer's routers take it: int64 indices, ``NO_ROUTE`` where there is no row."""
    blank = 255 if batch.dtype is torch.uint8 else NO_ROUTE
    return batch.long().masked_fill(batch == blank, NO_ROUTE)
