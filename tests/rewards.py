"""Test doubles for reward functions, given to jobs as `rollout.reward: tests.rewards:<name>`."""

from __future__ import annotations

import os

from elastic_rl.rollout.rewards import toy_copy


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


async def copied_by_key_raising_on_sevens(item) -> dict:
    """raises_on_sevens as a reward_function: async, given the whole sample, and returning a dict whose
    "copied" entry is the reward (rollout.reward_key). The response may hold a tool's answer after the
    model's text, so it is scored on how it starts."""
    if item.prompt.label == "7":
        raise ValueError("no rule for sevens")
    return {"copied": float(item.response.startswith(item.prompt.label)), "turns": item.sample.metadata.get("turns")}


def exits_the_process(prompt: str, response: str, label: str) -> float:
    """A fake crash: the orchestrator process dies as from a segfault in native code, every time."""
    os._exit(3)


def group_copy_rate(items) -> list[float]:
    """The toy task's score with no signal between samples (a rollout.group_reward_function): every sample
    of a group gets its group's mean toy_copy score. rollout/reward_mean is still the task's score, while
    every GRPO advantage is 0: a job learns the task only from what else shapes its advantages (a
    distillation teacher)."""
    share = sum(toy_copy(item.prompt.text, item.response, item.prompt.label) for item in items) / len(items)
    return [share] * len(items)
