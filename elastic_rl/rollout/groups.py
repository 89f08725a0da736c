"""Scored groups, the unit the rollout side generates, filters, buffers and trains, and the buffer
that carries groups from one rollout to the next.

A group is one prompt's ``n_samples_per_prompt`` responses, each with its
tokens, the engine's log probs, the weight version of each segment that made
it, its status and its reward (None when the reward could not be computed).
Groups a rollout generated beyond its need wait in the ``GroupBuffer``, and so
do groups a partial rollout aborted mid-generation, to be continued by the next
rollout. The buffer is committed with every rollout (in its meta.json, beside
the data source's state), so a restarted orchestrator takes up exactly the
groups the lost one held: nothing generated is lost or trained twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

import torch

from checkpoints.rollout_log import RolloutBatch
from elastic_rl import routing_record
from elastic_rl.rollout.data import Prompt
from elastic_rl.routing_record import RoutingShape

BufferChoice = Callable[[list["Group"], int], list[int]]
"""Given the buffered groups and how many a rollout wants, the indices of those it takes."""


class SampleStatus(Enum):
    COMPLETED = "completed"
    """Ended by an end-of-sequence token or a stop string."""
    TRUNCATED = "truncated"
    """Ended at rollout.max_new_tokens."""
    ABORTED = "aborted"
    """Ended by an abort outside partial rollout: trained as it is."""
    UNFINISHED = "unfinished"
    """Not generated to its end yet: stopped by a partial rollout (the next rollout continues it), or
    not begun."""

    @classmethod
    def from_finish_reason(cls, reason: str, partial_rollout: bool) -> SampleStatus:
        """From the engine's finish reason (SGLang's: stop, length or abort); an abort ends a sample
        only outside partial rollout."""
        aborted = cls.UNFINISHED if partial_rollout else cls.ABORTED
        return {"stop": cls.COMPLETED, "length": cls.TRUNCATED, "abort": aborted}[reason]


@dataclass
class Segment:
    """Tokens of a sample generated in one request, by one weight version."""

    version: int
    tokens: int


@dataclass
class Sample:
    output_ids: list[int]
    logprobs: list[float]
    """The engine's log prob of each output token, whichever segment made it."""
    segments: list[Segment]
    status: SampleStatus
    reward: float | None = None
    """None: the reward function raised, or returned something other than a finite number."""
    loss_mask: list[int] | None = None
    """1 at each output token the model generated, 0 at one a tool inserted; None: all the model's."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """What a rollout.generate_function reported about the sample (turns, tool calls)."""
    error: str | None = None
    """Why a rollout.generate_function could not make it: it cannot be scored."""
    routing: torch.Tensor | None = field(default=None, compare=False)
    """With algorithm.routing_replay: the experts each of its tokens was routed to (``elastic_rl.routing_record``)."""
    teacher_logprobs: list[float] | None = None
    """With teacher engines: the teacher's log prob of each output token, once it has scored them."""

    @property
    def version(self) -> int | None:
        """The weight version that began it (the oldest); None before its first token."""
        return self.segments[0].version if self.segments else None

    @property
    def finished(self) -> bool:
        return self.status is not SampleStatus.UNFINISHED

    def continued(
        self,
        output_ids: list[int],
        logprobs: list[float],
        version: int,
        status: SampleStatus,
        routing: torch.Tensor | None = None,
    ) -> Sample:
        """This sample with what one more request generated (``routing``: that request's record)."""
        segments = list(self.segments)
        if output_ids or status is not SampleStatus.UNFINISHED:  # a finished sample has a version, even if empty
            segments.append(Segment(version, len(output_ids)))
        return Sample(
            self.output_ids + output_ids,
            self.logprobs + logprobs,
            segments,
            status,
            routing=routing_record.continued(self.routing, routing),
        )

    @classmethod
    def unstarted(cls) -> Sample:
        """A sample no request has generated yet."""
        return cls([], [], [], SampleStatus.UNFINISHED)

    def to_json(self) -> dict[str, Any]:
        routing = None if self.routing is None else routing_record.to_json(self.routing)
        return {**asdict(replace(self, routing=None)), "status": self.status.value, "routing": routing}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sample:
        return cls(
            list(data["output_ids"]),
            list(data["logprobs"]),
            [Segment(**segment) for segment in data["segments"]],
            SampleStatus(data["status"]),
            data["reward"],
            data["loss_mask"],
            data["metadata"],
            data["error"],
            None if data.get("routing") is None else routing_record.from_json(data["routing"]),
            data.get("teacher_logprobs"),  # absent from a rollout log of format 3
        )


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
    def finished(self) -> bool:
        """Every sample generated to its end: the group can be scored (else a partial rollout aborted it)."""
        return all(sample.finished for sample in self.samples)

    @property
    def oldest_version(self) -> int | None:
        return min((sample.version for sample in self.samples if sample.version is not None), default=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": asdict(self.prompt),
            "prompt_ids": self.prompt_ids,
            "samples": [sample.to_json() for sample in self.samples],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Group:
        return cls(Prompt(**data["prompt"]), list(data["prompt_ids"]), [Sample.from_json(s) for s in data["samples"]])


def fifo(groups: list[Group], count: int) -> list[int]:
    """The oldest groups first."""
    return list(range(min(count, len(groups))))


class GroupBuffer:
    def __init__(self, groups: list[Group] | None = None):
        self.groups = list(groups or [])

    def __len__(self) -> int:
        return len(self.groups)

    def drop_older_than(self, version: int) -> list[Group]:
        """Remove and return the groups with a segment generated before ``version``."""
        stale = [group for group in self.groups if group.oldest_version is not None and group.oldest_version < version]
        self._remove(stale)
        return stale

    def take(self, count: int, choose: BufferChoice = fifo) -> list[Group]:
        """Remove and return up to ``count`` finished groups, the ones ``choose`` picks, in its order."""
        finished = [group for group in self.groups if group.finished]
        picked = list(dict.fromkeys(choose(list(finished), count)))[:count]
        if any(not isinstance(index, int) or not 0 <= index < len(finished) for index in picked):
            raise ValueError(f"rollout.buffer_filter picked {picked} from {len(finished)} buffered groups")
        taken = [finished[index] for index in picked]
        self._remove(taken)
        return taken

    def holds_unfinished(self) -> bool:
        return any(not group.finished for group in self.groups)

    def take_unfinished(self, count: int) -> list[Group]:
        """Remove and return up to ``count`` groups a partial rollout aborted, the oldest first."""
        taken = [group for group in self.groups if not group.finished][:count]
        self._remove(taken)
        return taken

    def _remove(self, groups: list[Group]) -> None:
        gone = {id(group) for group in groups}
        self.groups = [group for group in self.groups if id(group) not in gone]

    def add(self, groups: list[Group]) -> None:
        self.groups.extend(groups)

    def to_json(self) -> list[dict[str, Any]]:
        return [group.to_json() for group in self.groups]

    @classmethod
    def from_json(cls, data: list[dict[str, Any]]) -> GroupBuffer:
        return cls([Group.from_json(group) for group in data])


def to_batch(
    groups: list[Group], pad_id: int, routing_shape: RoutingShape | None = None, *, teacher: bool = False
) -> RolloutBatch:
    """The trainers' batch: every sample of every group, a group's samples contiguous; with
    ``routing_shape`` (algorithm.routing_replay) their routing records too, with ``teacher`` (teacher
    engines, which have scored every sample) the teacher's log probs."""
    rows = [(group, sample) for group in groups for sample in group.samples]
    width = max(len(group.prompt_ids) + len(sample.output_ids) for group, sample in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    engine_logprobs = torch.zeros(len(rows), width)
    loss_mask = torch.zeros(len(rows), width)
    teacher_logprobs = torch.zeros(len(rows), width) if teacher else None
    for i, (group, sample) in enumerate(rows):
        start, end = len(group.prompt_ids), len(group.prompt_ids) + len(sample.output_ids)
        tokens[i, :end] = torch.tensor(group.prompt_ids + sample.output_ids)
        engine_logprobs[i, start:end] = torch.tensor(sample.logprobs)
        if teacher_logprobs is not None:
            teacher_logprobs[i, start:end] = torch.tensor(sample.teacher_logprobs)
        loss_mask[i, start:end] = (
            1.0 if sample.loss_mask is None else torch.tensor(sample.loss_mask, dtype=torch.float32)
        )
    return RolloutBatch(
        tokens=tokens,
        prompt_lengths=torch.tensor([len(group.prompt_ids) for group, _ in rows]),
        response_lengths=torch.tensor([len(sample.output_ids) for _, sample in rows]),
        engine_logprobs=engine_logprobs,
        rewards=torch.tensor([sample.reward for _, sample in rows], dtype=torch.float32),
        prompt_indices=torch.tensor([group.prompt.index for group, _ in rows]),
        prompt_epochs=torch.tensor([group.prompt.epoch for group, _ in rows]),
        weight_versions=torch.tensor([sample.version for _, sample in rows]),
        loss_mask=loss_mask,
        routed_experts=None
        if routing_shape is None
        else routing_record.stored([sample.routing for _, sample in rows], width, routing_shape),
        teacher_logprobs=teacher_logprobs,
    )


def samples_record(groups: list[Group]) -> list[dict[str, Any]]:
    """Each trained sample's status, segments (weight version and token count of each) and metadata,
    in the batch's row order (for the rollout's meta)."""
    return [
        {
            "status": sample.status.value,
            "segments": [asdict(segment) for segment in sample.segments],
            **({"metadata": sample.metadata} if sample.metadata else {}),
        }
        for group in groups
        for sample in group.samples
    ]
