"""The data source: which prompts a rollout draws, with state that can be saved and restored.

Prompts come from a built-in task (``rollout.tasks``) or a JSONL file. Each epoch visits every
prompt once, in an order shuffled by (job seed, epoch); the source's state is
just (epoch, offset), so a restored source draws exactly the prompts the lost
one would have drawn next, and never one twice.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from elastic_rl.config import DataSpec
from elastic_rl.errors import SpecError
from elastic_rl.rollout.tasks import arithmetic, toy_copy

@dataclass(frozen=True)
class Prompt:
    index: int
    epoch: int
    text: str
    label: str


# Bad lines reported at once; a file with more is wrong throughout.
MAX_REPORTED_LINES = 20


def jsonl_lines(path: Path, prompt_key: str, label_key: str) -> list[tuple[int, str, str]]:
    """(line number, prompt, label) of each prompt in a JSONL file; every bad line is a ``SpecError``."""
    records, problems = [], []
    for line_number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.append(f"{path}:{line_number}: not valid JSON ({exc})")
            continue
        if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
            problems.append(f"{path}:{line_number}: not a JSON object with a string {prompt_key!r} (data.prompt_key)")
            continue
        records.append((line_number, row[prompt_key], str(row.get(label_key, ""))))
    if len(problems) > MAX_REPORTED_LINES:
        problems = problems[:MAX_REPORTED_LINES] + [f"{path}: {len(problems) - MAX_REPORTED_LINES} more bad lines"]
    if problems:
        raise SpecError(problems)
    if not records:
        raise SpecError([f"{path}: holds no prompts"])
    return records


class DataSource:
    def __init__(self, spec: DataSpec, seed: int):
        if spec.path is not None:
            self.records = [(text, label) for _, text, label in jsonl_lines(spec.path, spec.prompt_key, spec.label_key)]
        elif spec.task == "toy_copy":
            self.records = toy_copy(spec.num_prompts, seed, spec.toy_digits)
        else:
            self.records = arithmetic(spec.num_prompts, seed)
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
            text, label = self.records[index]
            prompts.append(Prompt(index=index, epoch=self.epoch, text=text, label=label))
            self.offset += 1
        return prompts

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
