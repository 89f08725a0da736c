"""Micro-batches by token budget: every row once, each group within the budget (padded: samples times the
longest; packed: the samples' own tokens), less padding."""

from __future__ import annotations

import pytest
import torch

from elastic_rl.trainer.micro_batches import fixed_micro_batches, padding_fraction, token_budget_micro_batches

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_rows_are_grouped_longest_first_within_the_budget():
    lengths = torch.tensor([10, 3, 7, 2, 10, 4])
    groups = token_budget_micro_batches(torch.arange(6), lengths, budget=20, packed=False)
    # Longest first: 10, 10 fill 20; 7 takes 4 (2 × 7 = 14) but not 3 (3 × 7 = 21); 3 takes 2.
    assert [g.tolist() for g in groups] == [[0, 4], [2, 5], [1, 3]]
    packed = token_budget_micro_batches(torch.arange(6), lengths, budget=20, packed=True)
    # Their own tokens: 10 + 10; 7 + 4 + 3 + 2 = 16.
    assert [g.tolist() for g in packed] == [[0, 4], [2, 5, 1, 3]]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_row_longer_than_the_budget_goes_alone(packed):
    groups = token_budget_micro_batches(torch.tensor([0, 1]), torch.tensor([50, 5]), budget=20, packed=packed)
    assert [g.tolist() for g in groups] == [[0], [1]]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_every_row_once_and_every_group_within_budget(packed):
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 60, (64,), generator=generator)
    rows = torch.arange(8, 40)
    groups = token_budget_micro_batches(rows, lengths, budget=128, packed=packed)
    assert sorted(torch.cat(groups).tolist()) == rows.tolist()
    held = [int(lengths[g].sum()) if packed else int(lengths[g].max()) * len(g) for g in groups]
    assert all(len(g) == 1 or tokens <= 128 for g, tokens in zip(groups, held))


def test_grouping_by_length_wastes_less_padding_than_fixed_micro_batches():
    lengths = torch.tensor([40, 5, 6, 38, 4, 7, 39, 5])
    fixed = fixed_micro_batches(torch.arange(8), 2)
    # Fixed pairs padded to the batch's width: 144 of 320 slots used.
    assert padding_fraction(fixed, lengths, width=40) == pytest.approx(1 - 144 / 320)
    grouped = token_budget_micro_batches(torch.arange(8), lengths, budget=80, packed=False)
    assert padding_fraction(grouped, lengths) < padding_fraction(fixed, lengths, width=40) / 2
