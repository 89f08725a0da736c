"""The checks a sample made by a user's function (a generate function's ``Generated``, a rollout
function's ``RolloutSample``) passes before the rollout uses it: each field of the right type, the
token lists of one length within ``max_new_tokens``, token ids in the vocabulary, a 0/1 loss mask,
finite log probabilities, a known status and metadata that the rollout's meta.json can hold. A
problem is a ``ValueError`` whose message names the field."""

from __future__ import annotations

import math
from typing import Any

import orjson

STATUSES = ("completed", "truncated")


def check_made(
    output_ids: Any,
    loss_mask: Any,
    logprobs: Any,
    status: Any,
    metadata: Any,
    max_new_tokens: int,
    vocab_size: int,
) -> None:
    for name, value in (("output_ids", output_ids), ("loss_mask", loss_mask), ("logprobs", logprobs)):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} is a {type(value).__name__}, not a list")
    if len({len(output_ids), len(loss_mask), len(logprobs)}) != 1:
        raise ValueError(
            f"output_ids, loss_mask and logprobs differ in length ({len(output_ids)}, {len(loss_mask)}, "
            f"{len(logprobs)})"
        )
    if len(output_ids) > max_new_tokens:
        raise ValueError(f"{len(output_ids)} tokens after the prompt, over max_new_tokens ({max_new_tokens})")
    for at, token in enumerate(output_ids):
        if type(token) is not int or not 0 <= token < vocab_size:
            raise ValueError(
                f"output_ids[{at}] is {token!r} ({type(token).__name__}), not a token id: an int from 0 to "
                f"{vocab_size - 1}"
            )
    if not all(type(bit) is int and bit in (0, 1) for bit in loss_mask):
        raise ValueError("loss_mask holds values other than the ints 0 and 1")
    for at, logprob in enumerate(logprobs):
        if not isinstance(logprob, (int, float)) or not math.isfinite(logprob) or logprob > 0:
            raise ValueError(f"logprobs[{at}] is {logprob!r}, not a log probability (finite, <= 0)")
    if status not in STATUSES:
        raise ValueError(f"status is {status!r}: use completed or truncated")
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata is a {type(metadata).__name__}, not a dict")
    try:  # committed in the rollout's meta.json, written as here
        orjson.dumps(metadata, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise ValueError(f"metadata is not JSON-serialisable: {exc}") from None
