"""How a shard of the global batch is cut into micro-batches for the forward and backward passes.

Either a fixed number of samples each (``trainer.micro_batch_size``), or, with
``trainer.max_tokens_per_micro_batch``, samples grouped by length so that each micro-batch
holds at most that many tokens: packed (``trainer.packing``), the samples' own tokens
(slime's dynamic batch size); padded, its samples times its longest one's length. The
losses are normalised by the global batch, so the gradient does not depend on the grouping.
"""

from __future__ import annotations

import torch


def fixed_micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``rows`` in order, ``size`` at a time."""
    return list(rows.split(size))


def token_budget_micro_batches(
    rows: torch.Tensor, lengths: torch.Tensor, budget: int, *, packed: bool
) -> list[torch.Tensor]:
    """``rows`` from longest to shortest, each micro-batch filled while its tokens stay within ``budget``:
    packed, the sum of its samples' lengths; padded, samples × the longest one's length. A sample longer
    than the budget goes alone. ``lengths[i]`` is row i's length."""
    order = sorted(rows.tolist(), key=lambda row: (-int(lengths[row]), row))
    groups: list[list[int]] = []
    held = 0  # the last group's tokens as the budget counts them
    for row in order:
        # Sorted longest first, so the group's first row is its longest.
        more = int(lengths[row]) if packed else int(lengths[groups[-1][0]]) if groups else 0
        if groups and held + more <= budget:
            groups[-1].append(row)
            held += more
        else:
            groups.append([row])
            held = int(lengths[row])
    return [torch.tensor(group) for group in groups]


def padding_fraction(micro_batches: list[torch.Tensor], lengths: torch.Tensor, width: int | None = None) -> float:
    """The share of token slots that are padding when each micro-batch is padded to ``width``
    (the whole batch's width), or, when None, to its own longest sample."""
    slots = used = 0
    for rows in micro_batches:
        padded = width if width is not None else int(lengths[rows].max())
        slots += padded * len(rows)
        used += int(lengths[rows].sum())
    return 1 - used / slots if slots else 0.0
