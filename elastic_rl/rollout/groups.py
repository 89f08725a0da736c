"""Scored groups, the unit the rollout side generates, filters, buffers and trains, and the buffer
that carries groups from one rollout to the next.

A group is one prompt's ``n_samples_per_prompt`` responses, each with its
tokens, the engine's log probs, the weight version that made it, how it ended
and its reward (None when the reward could not be computed). Groups a rollout
generated beyond its need wait in the ``GroupBuffer``. The buffer is committed
with every rollout (in its meta.json, beside the data source's state), so a
restarted orchestrator takes up exactly the groups the lost one held: nothing
generated is lost or trained twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from elastic_rl.rollout.batch import RolloutBatch
from elastic_rl.rollout.data import Prompt

BufferChoice = Callable[[list["Group"], int], list[int]]
"""Given the buffered groups and how many a rollout wants, the indices of those it takes."""


@dataclass
class Sample:
    output_ids: list[int]
    logprobs: list[float]
    version: int
    """The weight version that generated it."""
    finish: str
    """How generation ended (the engine's finish reason): stop, length or abort."""
    reward: float | None = None
    """None: the reward function raised, or returned something other than a finite number."""


@dataclass
class Group:
    prompt: Prompt
    prompt_ids: list[int]
    samples: list[Sample]

    @property
    def rewards(self) -> list[float | None]:
        return [sample.reward for sample in self.samples]

    @property
    def scored(self) -> bool:
        return all(reward is not None for reward in self.rewards)

    @property
    def oldest_version(self) -> int:
        return min(sample.version for sample in self.samples)

    def to_json(self) -> dict[str, Any]:
        return {"prompt": asdict(self.prompt), "prompt_ids": self.prompt_ids, "samples": [asdict(s) for s in self.samples]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Group:
        return cls(Prompt(**data["prompt"]), list(data["prompt_ids"]), [Sample(**s) for s in data["samples"]])


def fifo(groups: list[Group], count: int) -> list[int]:
    """The oldest groups first."""
    return list(range(min(count, len(groups))))


class GroupBuffer:
    def __init__(self, groups: list[Group] | None = None):
        self.groups = list(groups or [])

    def __len__(self) -> int:
        return len(self.groups)

    def drop_older_than(self, version: int) -> list[Group]:
        """Remove and return the groups with a sample generated before ``version``."""
        stale = [group for group in self.groups if group.oldest_version < version]
        self.groups = [group for group in self.groups if group.oldest_version >= version]
        return stale

    def take(self, count: int, choose: BufferChoice = fifo) -> list[Group]:
        """Remove and return up to ``count`` groups, the ones ``choose`` picks, in its order."""
        picked = list(dict.fromkeys(choose(list(self.groups), count)))[:count]
        if any(not 0 <= index < len(self.groups) for index in picked):
            raise ValueError(f"rollout.buffer_filter picked {picked} from {len(self.groups)} buffered groups")
        taken = [self.groups[index] for index in picked]
        left = set(range(len(self.groups))) - set(picked)
        self.groups = [group for index, group in enumerate(self.groups) if index in left]
        return taken

    def add(self, groups: list[Group]) -> None:
        self.groups.extend(groups)

    def to_json(self) -> list[dict[str, Any]]:
        return [group.to_json() for group in self.groups]

    @classmethod
    def from_json(cls, data: list[dict[str, Any]]) -> GroupBuffer:
        return cls([Group.from_json(group) for group in data])


def to_batch(groups: list[Group], pad_id: int) -> RolloutBatch:
    """The trainers' batch: every sample of every group, a group's samples contiguous."""
    rows = [(group, sample) for group in groups for sample in group.samples]
    width = max(len(group.prompt_ids) + len(sample.output_ids) for group, sample in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    engine_logprobs = torch.zeros(len(rows), width)
    for i, (group, sample) in enumerate(rows):
        start, end = len(group.prompt_ids), len(group.prompt_ids) + len(sample.output_ids)
        tokens[i, :end] = torch.tensor(group.prompt_ids + sample.output_ids)
        engine_logprobs[i, start:end] = torch.tensor(sample.logprobs)
    return RolloutBatch(
        tokens=tokens,
        prompt_lengths=torch.tensor([len(group.prompt_ids) for group, _ in rows]),
        response_lengths=torch.tensor([len(sample.output_ids) for _, sample in rows]),
        engine_logprobs=engine_logprobs,
        rewards=torch.tensor([sample.reward for _, sample in rows], dtype=torch.float32),
        prompt_indices=torch.tensor([group.prompt.index for group, _ in rows]),
        prompt_epochs=torch.tensor([group.prompt.epoch for group, _ in rows]),
        weight_versions=torch.tensor([sample.version for _, sample in rows]),
    )
