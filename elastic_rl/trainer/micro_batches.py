"""How a shard of the global batch is cut into micro-batches for the forward and backward passes.

Either a fixed number of samples each (``trainer.micro_batch_size``), or, with
``trainer.max_tokens_per_micro_batch``, samples grouped by length so that each micro-batch
holds at most that many tokens: packed (``trainer.packing``), the samples' own tokens
(slime's dynamic batch size); padded, its samples times its longest one's length. The
losses are normalised by the global batch, so the gradient does not depend on the grouping.
A ``MicroBatch`` is one group with its model input: padded, or packed end to end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from checkpoints.rollout_log import RolloutBatch
from elastic_rl.model.packing import ModelInput, packed_input, padded_input
from elastic_rl.model.token_scores import Entropy, token_scores
from elastic_rl.routing_record import replayable


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


@dataclass(frozen=True)
class MicroBatch:
    """Samples of the rollout that go through the model together, and how the model takes them."""

    rows: torch.Tensor
    width: int
    """Its longest sample's length, which the rollout's tensors are cut to for it."""
    model_input: ModelInput
    """Its samples padded to ``width`` or packed end to end (``trainer.packing``)."""

    @classmethod
    def of(cls, batch: RolloutBatch, rows: torch.Tensor, packed: bool) -> MicroBatch:
        lengths = batch.prompt_lengths[rows] + batch.response_lengths[rows]
        width = int(lengths.max())
        lay_out = packed_input if packed else padded_input
        routing = None if batch.routed_experts is None else replayable(batch.routed_experts[rows, :width])
        tokens, prompts = batch.tokens[rows, :width], batch.prompt_lengths[rows].cpu()
        return cls(rows, width, lay_out(tokens, prompts, lengths.cpu(), routing))

    @property
    def cut(self) -> tuple[torch.Tensor, slice]:
        return self.rows, slice(0, self.width)

    def scores(self, model, hidden: torch.Tensor, temperature: float, entropy: Entropy):
        """The log prob and entropy (None with ``Entropy.NONE``) of its tokens, ``[samples, width]`` as the
        rollout's tensors cut to it, 0 where nothing is scored, from the final hidden states of its scored
        positions."""
        item = self.model_input
        logp, ent = token_scores(model, hidden, item.targets, temperature, entropy)
        return item.spread(logp, self.width), None if ent is None else item.spread(ent, self.width)
