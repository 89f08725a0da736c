"""The data source: which prompts a rollout draws, with state that can be saved and restored.

Prompts come from a built-in task or a JSONL file. Each epoch visits every
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

# The toy task: a prompt is a short string and "=", the answer repeats the string.
TOY_ALPHABET = "0123456789"
TOY_LENGTH = 1


@dataclass(frozen=True)
class Prompt:
    index: int
    epoch: int
    text: str
    label: str


def toy_copy_records(count: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        answer = "".join(rng.choice(TOY_ALPHABET) for _ in range(TOY_LENGTH))
        records.append((f"{answer}=", answer))
    return records


def jsonl_records(path: Path, prompt_key: str, label_key: str) -> list[tuple[str, str]]:
    records = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
            records.append((str(row[prompt_key]), str(row.get(label_key, ""))))
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise SpecError([f"{path}:{line_number}: not a JSON object with {prompt_key!r}: {exc}"]) from None
    if not records:
        raise SpecError([f"{path}: holds no prompts"])
    return records


class DataSource:
    def __init__(self, spec: DataSpec, seed: int):
        if spec.path is not None:
            self.records = jsonl_records(spec.path, spec.prompt_key, spec.label_key)
        else:
            self.records = toy_copy_records(spec.num_prompts, seed)
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
