"""The data source: which prompts a rollout draws, with state that can be saved and restored.

Prompts come from a built-in task (``rollout.tasks``) or a JSONL file, whose lines are prompts
with their labels or, for SFT, chats of several turns. Each epoch visits every
prompt once, in an order shuffled by (job seed, epoch); the source's state is
just (epoch, offset), so a restored source draws exactly the prompts the lost
one would have drawn next, and never one twice.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from elastic_rl.errors import SpecError
from elastic_rl.rollout.tasks import arithmetic, toy_copy
from elastic_rl.spec.data import DataSpec

Chat = tuple[tuple[str, str], ...]
"""A conversation: each message's (role, content), in order."""

ASSISTANT = "assistant"


@dataclass(frozen=True)
class Prompt:
    index: int
    epoch: int
    text: str
    label: str
    chat: Chat = ()
    """For SFT on chat data: the conversation, trained on its assistant turns (text and label are empty)."""


# Bad lines reported at once; a file with more is wrong throughout.
MAX_REPORTED_LINES = 20


def read_chat(messages: Any, key: str) -> Chat:
    """A JSONL line's chat; ``ValueError`` saying what is wrong with it."""
    where = f"{key!r} (data.messages_key)"
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} is not a non-empty list of messages")
    if not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError(f"each message in {where} needs a string 'role' and a string 'content'")
    roles = [message["role"] for message in messages]
    if ASSISTANT not in roles:
        raise ValueError(f"no {ASSISTANT!r} message in {where}: SFT trains on the assistant's turns")
    if roles[0] == ASSISTANT:
        raise ValueError(f"{where} begins with the assistant's message: give the message it answers first")
    return tuple((message["role"], message["content"]) for message in messages)


def jsonl_lines(path: Path, data: DataSpec) -> list[tuple[int, str, str, Chat]]:
    """(line number, prompt, label, chat) of each line of a JSONL file; every bad line is a ``SpecError``.

    A line is a prompt (data.prompt_key) with its label (data.label_key), or a chat (data.messages_key),
    whose prompt and label are empty; ``prompts.check_data`` refuses chats where nothing trains on them.
    """
    records, problems = [], []
    for line_number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.append(f"{path}:{line_number}: not valid JSON ({exc})")
            continue
        if isinstance(row, dict) and data.messages_key in row:
            try:
                records.append((line_number, "", "", read_chat(row[data.messages_key], data.messages_key)))
            except ValueError as exc:
                problems.append(f"{path}:{line_number}: {exc}")
            continue
        if not isinstance(row, dict) or not isinstance(row.get(data.prompt_key), str):
            problems.append(
                f"{path}:{line_number}: not a JSON object with a string {data.prompt_key!r} (data.prompt_key) "
                f"or a chat in {data.messages_key!r} (data.messages_key)"
            )
            continue
        records.append((line_number, row[data.prompt_key], str(row.get(data.label_key, "")), ()))
    if len(problems) > MAX_REPORTED_LINES:
        problems = problems[:MAX_REPORTED_LINES] + [f"{path}: {len(problems) - MAX_REPORTED_LINES} more bad lines"]
    if problems:
        raise SpecError(problems)
    if not records:
        raise SpecError([f"{path}: holds no prompts"])
    return records


class DataSource:
    def __init__(self, spec: DataSpec, seed: int):
        self.records: list[tuple[str, str, Chat]]
        if spec.path is not None:
            self.records = [(text, label, chat) for _, text, label, chat in jsonl_lines(spec.path, spec)]
        elif spec.task == "toy_copy":
            self.records = [(text, label, ()) for text, label in toy_copy(spec.num_prompts, seed, spec.toy_digits)]
        else:
            self.records = [(text, label, ()) for text, label in arithmetic(spec.num_prompts, seed)]
        self.shuffle = spec.shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def draw(self, count: int) -> list[Prompt]:
        prompts = []
        order = self._order(self.epoch)
        while len(prompts) < count:
            if self.offset == len(order):
                self.epoch, self.offset = self.epoch + 1, 0
                order = self._order(self.epoch)
            index = order[self.offset]
            text, label, chat = self.records[index]
            prompts.append(Prompt(index=index, epoch=self.epoch, text=text, label=label, chat=chat))
            self.offset += 1
        return prompts

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
