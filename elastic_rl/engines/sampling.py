"""Sampling parameters as SGLang names them, and the choice of the next token.

``SamplingParams.from_json`` validates a request's ``sampling_params`` and names
the offending key on error. ``choose_next_token`` turns one row of logits into a
token and its log probability. The log probability is taken under the
temperature-scaled distribution before top-k/top-p truncation, the distribution
the trainer recomputes; at temperature 0 it is that of the raw logits.

A seeded request draws the token at each position from a generator keyed by
(seed, position) alone (``position_generator``), as SGLang's deterministic
sampling hashes (seed, position): a request continued from some of its tokens
on another engine draws what the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

# SGLang's default when a request gives no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128


class InvalidRequest(ValueError):
    """A request the engine refuses, with a message naming the field."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> SamplingParams:
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        # SGLang's name for a per-request seed.
        if "sampling_seed" in data:
            data["seed"] = data.pop("sampling_seed")
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequest(f"sampling_params: unknown key(s) {unknown}; known: {sorted(known)}")
        stop = data.get("stop") or ()
        params = cls(
            **{
                **data,
                "stop_token_ids": tuple(data.get("stop_token_ids") or ()),
                "stop": (stop,) if isinstance(stop, str) else tuple(stop),
            }
        )
        params._check()
        return params

    def _check(self) -> None:
        if not self.temperature >= 0:
            raise InvalidRequest(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest(f"sampling_params.top_k must be -1 or positive, got {self.top_k}")
        if not all(isinstance(text, str) and text for text in self.stop):
            raise InvalidRequest(
                f"sampling_params.stop must be a string or a list of non-empty strings, got {self.stop}"
            )
        if self.max_new_tokens < 0:
            raise InvalidRequest(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator that draws a seeded request's token after ``position`` (the index, prompt included, of
    the last token the logits were computed at): the same for the same seed and position in any process."""
    digest = hashlib.blake2b(f"{seed}/{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def choose_next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """The next token for one sequence and its log probability. ``logits``: [vocab], float32."""
    if params.temperature == 0:
        log_probs = logits.log_softmax(-1)
        token = int(torch.argmax(logits))
        return token, float(log_probs[token])
    scaled = logits / params.temperature
    log_probs = scaled.log_softmax(-1)
    probs = _truncate(scaled, params.top_k, params.top_p).softmax(-1)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(log_probs[token])
