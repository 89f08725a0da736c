"""Group-normalised advantages (GRPO): each sample's reward against its group's."""

from __future__ import annotations

import torch

EPSILON = 1e-6


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_by_std: bool = True) -> torch.Tensor:
    """Per-sample advantages. ``rewards``: [num_groups * group_size], groups contiguous.

    A group whose rewards are all equal carries no signal: its advantages are 0.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + EPSILON)
    return centred.reshape(-1)
