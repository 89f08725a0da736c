"""Test doubles for reward functions, given to jobs as `rollout.reward: tests.rewards:<name>`."""

from __future__ import annotations


def fake_digit_share(prompt: str, response: str, label: str) -> float:
    """A fake reward: the share of the response's characters that are digits. It differs between
    almost any two samples, so every GRPO group has a gradient whatever the model knows."""
    return sum(ch.isdigit() for ch in response) / max(1, len(response))
