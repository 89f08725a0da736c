"""A rollout batch on disk: what the orchestrator hands the trainers through the work dir.

``workdir/rollouts/<id>/`` holds ``batch.safetensors`` (the tensors below) and
``meta.json`` (rollout id, weight version, the data source's state after the
draw, and the rollout's own metrics), and a manifest of their sizes and
checksums. The folder appears atomically, so a trainer never sees half a
batch. Samples of a GRPO group are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import orjson
import torch
from safetensors.torch import load_file, save_file

from checkpoints.manifest import write_manifest
from elastic_rl.atomic import atomic_directory
from elastic_rl.jobenv import META_FILE, rollout_dir

BATCH_FILE = "batch.safetensors"


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # int64 [N, L]: prompt + response, right-padded
    prompt_lengths: torch.Tensor  # int64 [N]
    response_lengths: torch.Tensor  # int64 [N]
    engine_logprobs: torch.Tensor  # float32 [N, L]: log p(tokens[:, t]) at response positions, else 0
    rewards: torch.Tensor  # float32 [N]
    prompt_indices: torch.Tensor  # int64 [N]: dataset index of each sample's prompt
    prompt_epochs: torch.Tensor  # int64 [N]
    weight_versions: torch.Tensor  # int64 [N]: weights that generated each sample

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def response_mask(self) -> torch.Tensor:
        """float32 [N, L]: 1 at the response tokens."""
        positions = torch.arange(self.tokens.shape[1], device=self.tokens.device).unsqueeze(0)
        start = self.prompt_lengths.unsqueeze(1)
        return ((positions >= start) & (positions < start + self.response_lengths.unsqueeze(1))).float()

    def select(self, rows: torch.Tensor | slice) -> RolloutBatch:
        return RolloutBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The batch on ``device`` (itself when it is there already)."""
        return RolloutBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def write_rollout(workdir: Path, rollout_id: int, batch: RolloutBatch, meta: dict[str, Any]) -> Path:
    target = rollout_dir(workdir, rollout_id)
    with atomic_directory(target) as temp:
        save_file({f.name: getattr(batch, f.name).contiguous() for f in fields(batch)}, str(temp / BATCH_FILE))
        (temp / META_FILE).write_bytes(orjson.dumps({"rollout_id": rollout_id, **meta}, option=orjson.OPT_SORT_KEYS))
        write_manifest(temp, {"rollout_id": rollout_id})
    return target


def read_rollout(workdir: Path, rollout_id: int) -> tuple[RolloutBatch, dict[str, Any]]:
    folder = rollout_dir(workdir, rollout_id)
    tensors = load_file(str(folder / BATCH_FILE))
    return RolloutBatch(**tensors), orjson.loads((folder / META_FILE).read_bytes())
