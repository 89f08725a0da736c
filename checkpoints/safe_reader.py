"""A DCP reader that unpickles a snapshot's metadata with an allow-list.

DCP reads tensor data with ``torch.load(weights_only=True)`` but its
``.metadata`` file with plain ``pickle.load``, which would run whatever a
crafted file names. ``SafeFileSystemReader`` admits only the types DCP's
metadata is made of: its own metadata classes, torch's Size, dtypes, layouts
(and the by-name lookup that unpickles them) and memory formats, paths, and a
few plain containers. Anything else is refused.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    # How torch pickles a layout: a lookup of torch.strided and kin by name.
    ("torch.serialization", "_get_layout"),
    # DCP records the checkpoint's path.
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"snapshot metadata names {module}.{name}, which a snapshot never holds")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
