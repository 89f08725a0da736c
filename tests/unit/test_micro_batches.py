"""Micro-batches by token budget: every row once, each group within the budget, less padding."""

from __future__ import annotations

import pytest
import torch

from elastic_rl.trainer.micro_batches import fixed_micro_batches, padding_fraction, token_budget_micro_batches

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_rows_are_packed_longest_first_within_the_budget():
    lengths = torch.tensor([10, 3, 7, 2, 10, 4])
    groups = token_budget_micro_batches(torch.arange(6), lengths, budget=20)
    # Longest first: 10, 10 fill 20; 7 takes 4 (2 × 7 = 14) but not 3 (3 × 7 = 21); 3 takes 2.
    assert [g.tolist() for g in groups] == [[0, 4], [2, 5], [1, 3]]


def test_a_row_longer_than_the_budget_goes_alone():
    groups = token_budget_micro_batches(torch.tensor([0, 1]), torch.tensor([50, 5]), budget=20)
    assert [g.tolist() for g in groups] == [[0], [1]]


def test_every_row_once_and_every_group_within_budget():
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 60, (64,), generator=generator)
    rows = torch.arange(8, 40)
    groups = token_budget_micro_batches(rows, lengths, budget=128)
    assert sorted(torch.cat(groups).tolist()) == rows.tolist()
    assert all(len(g) == 1 or int(lengths[g].max()) * len(g) <= 128 for g in groups)


def test_grouping_by_length_wastes_less_padding_than_fixed_micro_batches():
    lengths = torch.tensor([40, 5, 6, 38, 4, 7, 39, 5])
    fixed = fixed_micro_batches(torch.arange(8), 2)
    # Fixed pairs padded to the batch's width: 144 of 320 slots used.
    assert padding_fraction(fixed, lengths, width=40) == pytest.approx(1 - 144 / 320)
    grouped = token_budget_micro_batches(torch.arange(8), lengths, budget=80)
    assert padding_fraction(grouped, lengths) < padding_fraction(fixed, lengths, width=40) / 2
