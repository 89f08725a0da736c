"""The rollout log: each rollout's batch as the orchestrator committed it, for the trainers to apply
and for a resume to replay.

``rollouts/<N>/`` holds ``batch.safetensors`` (the tensors of a
``RolloutBatch``; with algorithm.routing_replay, each sample's routing
record among them; with teacher engines, the teacher's log probs),
``meta.json`` (the sampler's state after the rollout: data source, buffer,
bad samples in a row; the prompts drawn, the groups dropped and why, each
sample's status, the rollout's metrics) and a manifest of their sizes and
checksums. The meta records the log's format: a rollout of another format
(written by another version of elastic-rl) is refused, never half read.
Formats 2 and 3 are the exceptions: they differ only in having no routing
records (2) and no teacher's log probs (2 and 3), and are read as batches
without them (the trainer's own routers route the tokens; a job that had no
teacher engines has no use for their log probs, and one resumed with them
turned on stops at the first rollout without them, naming it). The folder
appears atomically, so a trainer never sees half a batch. Samples of a GRPO group are contiguous. A rollout the NaN
guard rolls back is quarantined: every trainer skips it, on a replay too.
Retention cuts the log below the oldest snapshot kept (``cut_below``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import orjson
import torch
from safetensors.torch import load_file, save_file

from checkpoints.layout import META_FILE, committed_rollouts, quarantine_path, rollout_dir
from checkpoints.manifest import write_manifest
from elastic_rl.atomic import atomic_directory, write_file_atomic
from elastic_rl.errors import RolloutLogError

BATCH_FILE = "batch.safetensors"
LOG_FORMAT = 4
"""Written in every rollout's meta; one more whenever the batch's tensors or the meta's keys change
(2: loss masks, sample metadata and errors in the buffer, the bad-data count; 3: routing records in the
batch and in the buffer's samples; 4: the teacher engines' log probs, likewise)."""
READABLE_FORMATS = (2, 3, LOG_FORMAT)
"""What ``read_meta`` reads: format 3 is format 4 without teacher log probs, format 2 also without routing
records."""


def response_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """float32 [N, width]: 1 at the response tokens."""
    positions = torch.arange(width, device=prompt_lengths.device).unsqueeze(0)
    start = prompt_lengths.unsqueeze(1)
    return ((positions >= start) & (positions < start + response_lengths.unsqueeze(1))).float()


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
    loss_mask: torch.Tensor  # float32 [N, L]: 1 at the response tokens the model generated (not a tool's)
    routed_experts: torch.Tensor | None = None
    """uint8 or int16 [N, L, layers, topk]: each token's experts as the engine routed it, with
    algorithm.routing_replay (``elastic_rl.routing_record``); None otherwise."""
    teacher_logprobs: torch.Tensor | None = None
    """float32 [N, L]: the teacher engines' log prob of each response token (at its position, as
    engine_logprobs), with algorithm.distillation.engines; None otherwise."""

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors by field name, those it does not hold left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def select(self, rows: torch.Tensor | slice) -> RolloutBatch:
        return RolloutBatch(**{name: tensor[rows] for name, tensor in self.tensors().items()})

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The batch on ``device`` (itself when it is there already)."""
        return RolloutBatch(**{name: tensor.to(device) for name, tensor in self.tensors().items()})


def write_rollout(workdir: Path, rollout_id: int, batch: RolloutBatch, meta: dict[str, Any]) -> Path:
    target = rollout_dir(workdir, rollout_id)
    with atomic_directory(target) as temp:
        save_file({name: tensor.contiguous() for name, tensor in batch.tensors().items()}, str(temp / BATCH_FILE))
        record = {**meta, "rollout_id": rollout_id, "format": LOG_FORMAT}
        (temp / META_FILE).write_bytes(orjson.dumps(record, option=orjson.OPT_SORT_KEYS))
        write_manifest(temp, {"rollout_id": rollout_id})
    return target


def read_rollout(workdir: Path, rollout_id: int) -> tuple[RolloutBatch, dict[str, Any]]:
    folder = rollout_dir(workdir, rollout_id)
    meta = read_meta(folder)
    return RolloutBatch(**load_file(str(folder / BATCH_FILE))), meta


def committed_teacher_logprobs(batch: RolloutBatch, rollout_id: int) -> torch.Tensor:
    """The teacher engines' log probs committed with rollout ``rollout_id``; RolloutLogError if it was
    committed without them (format 3 or earlier, or by a job without teacher engines)."""
    if batch.teacher_logprobs is None:
        raise RolloutLogError(
            f"rollout {rollout_id} was committed without the teacher engines' log probs (by a version of "
            "elastic-rl without them, or a job without algorithm.distillation.engines): resume the job as it ran"
        )
    return batch.teacher_logprobs


def read_meta(folder: Path) -> dict[str, Any]:
    """A committed rollout's meta; RolloutLogError if the rollout is of another format."""
    path = folder / META_FILE
    meta = orjson.loads(path.read_bytes())
    found = meta.get("format", 1)  # format 1 had no number
    if found not in READABLE_FORMATS:
        raise RolloutLogError(
            f"{path}: a rollout log of format {found}, written by another version of elastic-rl; this one reads "
            f"formats {', '.join(map(str, READABLE_FORMATS))} only: run the job in a new work dir (for "
            "debug.train_only, generate the log again)"
        )
    return meta


def batch_rows(workdir: Path, rollout_id: int) -> int:
    """The samples in a committed rollout, from its batch file's header (no tensor is read); the
    rollout's format is checked first."""
    folder = rollout_dir(workdir, rollout_id)
    read_meta(folder)
    with open(folder / BATCH_FILE, "rb") as handle:
        header = orjson.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    return int(header["tokens"]["shape"][0])


def quarantine(workdir: Path, rollout_id: int, step: int, reason: str) -> None:
    """Set a rollout aside: the NaN guard found it poisons the weights."""
    write_file_atomic(
        quarantine_path(workdir, rollout_id), orjson.dumps({"rollout_id": rollout_id, "step": step, "reason": reason})
    )


def cut_below(workdir: Path, rollout_id: int) -> None:
    """Delete the committed rollouts before ``rollout_id`` (no kept snapshot replays them)."""
    for committed in committed_rollouts(workdir):
        if committed < rollout_id:
            shutil.rmtree(rollout_dir(workdir, committed), ignore_errors=True)
