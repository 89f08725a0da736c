"""A packed micro-batch split over context-parallel ranks: each sample padded to 2 x CP chunks, rank r
holding chunks r and 2CP-1-r, and every scored position scored by exactly one rank, worked out by hand."""

from __future__ import annotations

import pytest
import torch

from elastic_rl.model.packing import packed_input

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_each_rank_holds_its_two_chunks_of_every_sample_and_the_positions_scored_there():
    # Two samples of 6 and 9 tokens (prompts of 2 and 3), packed less their last tokens: 5 + 8 positions.
    tokens = torch.zeros(2, 9, dtype=torch.long)
    tokens[0, :6] = torch.arange(10, 16)
    tokens[1, :9] = torch.arange(20, 29)
    whole = packed_input(tokens, torch.tensor([2, 3]), torch.tensor([6, 9]))
    assert whole.bounds.tolist() == [0, 5, 13]
    ranks = [whole.split_over_context(rank, 2) for rank in range(2)]
    # Each sample padded to 8 and cut in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    # (0: padding beyond a sample's end).
    assert ranks[0].tokens.tolist() == [[10, 11, 0, 0, 20, 21, 26, 27]]
    assert ranks[1].tokens.tolist() == [[12, 13, 14, 0, 22, 23, 24, 25]]
    assert [split.bounds.tolist() for split in ranks] == [[0, 8, 16]] * 2
    # The scored positions (before each response token: 1-4 and 7-12 of the pack), at their local slots.
    assert ranks[0].positions.tolist() == [1, 6, 7]
    assert ranks[1].positions.tolist() == [0, 1, 2, 4, 5, 6, 7]
    # Together the ranks score every position once, each with its own target and place.
    places = sorted(
        (int(row), int(column), int(target))
        for split in ranks
        for row, column, target in zip(*split.places, split.targets[0])
    )
    assert places == sorted(
        (int(row), int(column), int(target)) for row, column, target in zip(*whole.places, whole.targets[0])
    )
    assert sum(split.targets.shape[1] for split in ranks) == whole.targets.shape[1] == 10


def test_a_ranks_share_made_up_to_a_multiple_by_a_sample_of_padding():
    # One sample of 5 positions at CP=2: padded to 8, a rank holds 4. Split again over 3 tensor-parallel
    # ranks (sequence parallelism), a rank's share grows to 6: a sample of 4 padding tokens, 1 a chunk.
    tokens = torch.arange(10, 16).unsqueeze(0)
    whole = packed_input(tokens, torch.tensor([2]), torch.tensor([6]))
    ranks = [whole.split_over_context(rank, 2, multiple=3) for rank in range(2)]
    assert ranks[0].tokens.tolist() == [[10, 11, 0, 0, 0, 0]]
    assert ranks[1].tokens.tolist() == [[12, 13, 14, 0, 0, 0]]
    assert [split.bounds.tolist() for split in ranks] == [[0, 8, 12]] * 2
    # The same positions scored as without the padding sample.
    plain = [whole.split_over_context(rank, 2) for rank in range(2)]
    assert [split.positions.tolist() for split in ranks] == [split.positions.tolist() for split in plain]
    assert [split.tokens.shape[1] for split in plain] == [4, 4]
    # Over 2 tensor-parallel ranks the 4 already split evenly: no padding sample.
    assert [whole.split_over_context(rank, 2, multiple=2).bounds.tolist() for rank in range(2)] == [[0, 8]] * 2
