"""A streamed ``/generate`` answer, put together as its chunks arrive.

SGLang streams server-sent events: a ``data: <json>`` line per chunk, then
``data: [DONE]``. By default a chunk holds everything generated so far; with
``--incremental-streaming-output`` only what is new (and, in SGLang before
its fix of March 2026, the log probs still whole). In both, a chunk's
``meta_info.completion_tokens`` counts every token so far, so the new tokens
are the last ``completion_tokens - received`` of its ``output_ids`` and log
probs: ``Received.add`` reads either kind the same way. A chunk must hold
exactly the new tokens or exactly every token so far (and its log probs
likewise): one that holds another count is not what the engine generated,
and breaks the stream rather than shift the sample's tokens. What has
arrived is kept when the stream breaks: the caller continues the request
from it. A mixture of experts' routing record (``elastic_rl.routing_record``),
when asked for, comes in a chunk either whole (a row for each token of the
input and each generated token but the last) or as the rows after those sent
before; one that is neither breaks the stream like a token count that does
not add up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from elastic_rl.errors import EngineError
from elastic_rl.routing_record import WIRE_KEY, RoutingShape, decode_wire

DONE = b"[DONE]"


@dataclass
class Received:
    """The tokens of one streamed request so far, and the newest chunk's meta_info."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    routing_shape: RoutingShape | None = None
    """Set when the request asked for the routing record: how to read it."""
    routing: torch.Tensor | None = field(default=None, compare=False)
    """The request's routing record so far (its input's tokens and what it generated, less the last)."""
    input_tokens: int = 0
    """The request's input length, set as it is sent: the routing record's rows start with its tokens."""

    @property
    def finished(self) -> bool:
        """The engine said how the request ended (stop, length or abort)."""
        return self.meta.get("finish_reason") is not None

    def add(self, chunk: dict[str, Any]) -> int:
        """Take one chunk; returns how many tokens it added. Raises EngineError for an error chunk or one
        that does not add up: its tokens or log probs neither the new ones nor all so far."""
        if "error" in chunk:
            raise EngineError(f"the engine failed the request mid-stream: {chunk['error']}")
        meta = chunk["meta_info"]
        total = meta["completion_tokens"]
        new = total - len(self.output_ids)
        entries = meta.get("output_token_logprobs")
        held = [len(chunk["output_ids"])] + ([] if entries is None else [len(entries)])
        if new < 0 or any(count not in (new, total) for count in held):
            raise EngineError(
                f"a streamed chunk counts {total} tokens, {len(self.output_ids)} received before, but holds "
                f"{held[0]} token(s)" + ("" if entries is None else f" and {held[-1]} log prob(s)")
            )
        if self.routing_shape is not None and meta.get(WIRE_KEY):
            self.routing = self._routing_with(meta[WIRE_KEY], total)
        if new > 0:
            self.output_ids += chunk["output_ids"][-new:]
            if entries is not None:
                self.logprobs += [entry[0] for entry in entries[-new:]]
        self.meta = meta
        return max(new, 0)

    def _routing_with(self, encoded: str, total: int) -> torch.Tensor:
        """The record once a chunk's rows are taken; EngineError for rows that are neither the whole record
        of ``total`` generated tokens nor the rows after those held."""
        try:
            rows = decode_wire(encoded, self.routing_shape)
        except ValueError as exc:
            raise EngineError(f"a streamed chunk's routing record is unreadable: {exc}") from None
        whole = self.input_tokens + total - 1
        held = 0 if self.routing is None else len(self.routing)
        if len(rows) == whole:
            return rows
        if held and held + len(rows) == whole:
            return torch.cat([self.routing, rows])
        raise EngineError(
            f"a streamed chunk's routing record holds {len(rows)} rows, {held} received before, for "
            f"{self.input_tokens} input and {total} generated tokens"
        )

    def answer(self) -> dict[str, Any]:
        """What ``/generate`` would have answered without streaming (less the text)."""
        meta = {key: value for key, value in self.meta.items() if key != WIRE_KEY}
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = [[lp, token, None] for lp, token in zip(self.logprobs, self.output_ids)]
        return {"output_ids": list(self.output_ids), "meta_info": meta}


def event_data(line: bytes) -> dict[str, Any] | None:
    """The chunk a ``data:`` line holds; None for any other line, and for ``[DONE]``."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[len(b"data:") :].strip()
    if payload == DONE:
        return None
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"a streamed chunk is not JSON: {payload[:200]!r}") from exc
