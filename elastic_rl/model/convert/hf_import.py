"""A Hugging Face checkpoint into a megatron model, at any tensor-parallel size.

Each rank reads only its own slices of the checkpoint's safetensors files
(``safe_open`` and ``get_slice``): rows of the column-parallel weights
(q/k/v by whole key/value groups, gate and up by the same rows), columns of the
row-parallel ones, vocabulary rows of the embedding and output layer, and the
norms whole. A pipeline stage reads its own layers (by the whole model's
numbers, ``elastic_rl.layer_names``), an expert-parallel rank its own experts,
and with a tied embedding the last stage reads the embedding for its copy.
Every megatron parameter must be filled and every tensor of the checkpoint
used by some rank, so a checkpoint that does not fit the architecture is an
error, never a half-loaded model. A mixture of experts may be stored expert by
expert or stacked (``layout.stacked_experts``).
"""

from __future__ import annotations

from pathlib import Path

import orjson
import torch
from safetensors import safe_open

from elastic_rl.architecture import Architecture
from elastic_rl.layer_names import whole_model_parameters
from elastic_rl.model.convert.layout import (
    HF_OUTPUT,
    StackedPart,
    fused_qkv,
    gated_fc1,
    one_to_one,
    query_groups,
    stacked_experts,
)

INDEX_FILE = "model.safetensors.index.json"
# Buffers some checkpoints store that the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsReader:
    """Whole tensors, or row or column ranges of them, from a checkpoint's safetensors files.

    A name the files lack is looked up in ``stacked`` (per-expert key -> its part of a layer's stacked
    experts), so a mixture of experts reads the same in either layout."""

    def __init__(self, folder: Path, stacked: dict[str, StackedPart] | None = None):
        index = folder / INDEX_FILE
        if index.is_file():
            weight_map = orjson.loads(index.read_bytes())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
        else:
            self.files = {}
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as handle:
                    self.files.update({name: file for name in handle.keys()})
        if not self.files:
            raise FileNotFoundError(f"{folder}: no safetensors weights")
        self.folder = folder
        self.stacked = stacked or {}
        self._handles: dict[Path, object] = {}
        self.read: set[str] = set()

    def _slice(self, name: str):
        if name not in self.files:
            raise ValueError(f"{self.folder}: no tensor {name}, which the architecture needs")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        self.read.add(name)
        return self._handles[file].get_slice(name)

    def dtype(self, name: str) -> str:
        """The stored dtype (safetensors' name for it: F32, BF16, ...), from the header alone."""
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file].get_slice(name).get_dtype()

    def full(self, name: str) -> torch.Tensor:
        return self._read(name, slice(None), slice(None))

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, slice(start, stop), slice(None))

    def columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, slice(None), slice(start, stop))

    def _read(self, name: str, rows: slice, columns: slice) -> torch.Tensor:
        part = self.stacked.get(name) if name not in self.files else None
        if part is None or part.expert is None:
            stored = self._slice(name if part is None else part.name)
            return (stored[rows] if columns == slice(None) else stored[rows, columns]).float()
        stored = self._slice(part.name)
        own_rows = part.rows if part.rows is not None else stored.get_shape()[1]
        start = part.first_row + (rows.start or 0)
        stop = part.first_row + (rows.stop if rows.stop is not None else own_rows)
        return stored[part.expert : part.expert + 1, start:stop, columns][0].float()


def _sharded(reader: SafetensorsReader, name: str, param: torch.nn.Parameter, rank: int) -> torch.Tensor:
    """This rank's part of a tensor megatron splits along ``partition_dim``, or the whole tensor."""
    if not getattr(param, "tensor_model_parallel", False):
        return reader.full(name)
    dim = param.partition_dim
    start = rank * param.shape[dim]
    read = reader.rows if dim == 0 else reader.columns
    return read(name, start, start + param.shape[dim])


def _qkv_slice(
    reader: SafetensorsReader, names: tuple[str, str, str], arch: Architecture, rank: int, tp: int
) -> torch.Tensor:
    """This rank's key/value groups of the fused q/k/v: [its q heads, k, v] per group."""
    per_group, head_dim = query_groups(arch)
    groups = arch.num_query_groups // tp
    first = rank * groups
    q = reader.rows(names[0], first * per_group * head_dim, (first + groups) * per_group * head_dim)
    k = reader.rows(names[1], first * head_dim, (first + groups) * head_dim)
    v = reader.rows(names[2], first * head_dim, (first + groups) * head_dim)
    trailing = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, per_group, head_dim, *trailing),
            k.reshape(groups, 1, head_dim, *trailing),
            v.reshape(groups, 1, head_dim, *trailing),
        ],
        dim=1,
    )
    return fused.reshape(-1, *trailing)


def stored_as_float32(folder: Path) -> bool:
    """Whether every tensor of the checkpoint is stored as float32 (read from the file headers only)."""
    reader = SafetensorsReader(folder)
    return all(reader.dtype(name) == "F32" for name in reader.files)


@torch.no_grad()
def import_hf_weights(model: torch.nn.Module, arch: Architecture, folder: Path, rank: int, tp: int) -> None:
    """Fill ``model`` (this rank's megatron shards of its stage) from the HF checkpoint in ``folder``."""
    reader = SafetensorsReader(folder, stacked_experts(arch))
    plain, qkv, fc1 = one_to_one(arch), fused_qkv(arch), gated_fc1(arch)
    for name, param in whole_model_parameters(model):
        if name in plain:
            value = _sharded(reader, plain[name], param, rank)
        elif name in qkv:
            value = _qkv_slice(reader, qkv[name], arch, rank, tp)
        elif name in fc1:
            rows = param.shape[0] // 2
            gate, up = fc1[name]
            value = torch.cat(
                [reader.rows(gate, rank * rows, (rank + 1) * rows), reader.rows(up, rank * rows, (rank + 1) * rows)]
            )
        else:
            raise ValueError(f"{folder}: the {arch.family} importer has no HF tensor for megatron's {name}")
        if value.shape != param.shape:
            raise ValueError(
                f"{folder}: {name} has shape {tuple(value.shape)} here, megatron expects {tuple(param.shape)}"
            )
        param.copy_(value)
    # What other pipeline stages, or other expert-parallel ranks, read.
    held = {name for name, _ in whole_model_parameters(model)}
    elsewhere = set()
    for table in (plain, qkv, fc1):
        for name, hf_names in table.items():
            if name not in held:
                elsewhere.update([hf_names] if isinstance(hf_names, str) else hf_names)
    elsewhere |= {reader.stacked[name].name for name in elsewhere if name in reader.stacked}
    ignored = elsewhere | ({HF_OUTPUT} if arch.tie_embeddings else set())
    unused = sorted(name for name in set(reader.files) - reader.read - ignored if not name.endswith(IGNORED_SUFFIXES))
    if unused:
        raise ValueError(f"{folder}: tensors the {arch.family} architecture does not use: {unused[:5]}")
