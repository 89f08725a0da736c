"""Test doubles for reward functions, given to jobs as `rollout.reward: tests.rewards:<name>`."""

from __future__ import annotations


def fake_digit_share(prompt: str, response: str, label: str) -> float:
    """A fake reward: the share of the response's characters that are digits. It differs between
    almost any two samples, so every GRPO group has a gradient whatever the model knows."""
    return sum(ch.isdigit() for ch in response) / max(1, len(response))


def raises_on_sevens(prompt: str, response: str, label: str) -> float:
    """A reward that cannot score the prompts labelled 7 (it raises), and copies the label otherwise."""
    if label == "7":
        raise ValueError("no rule for sevens")
    return float(response.strip() == label)


def always_raises(prompt: str, response: str, label: str) -> float:
    raise RuntimeError("the reward service is down")
