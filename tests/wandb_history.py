"""Reads the logged history back out of an offline W&B run file, for tests.

wandb keeps no Python reader of its own run files any more. The file is a
7-byte header followed by leveldb-log framing: 32 KiB blocks of records, each
with a 7-byte header (checksum, little-endian length, type) and a protobuf
``Record``. A record split across blocks comes in FIRST, MIDDLE.., LAST parts.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

FILE_HEADER = 7
BLOCK = 32 * 1024
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    found, pending, offset = [], b"", FILE_HEADER
    while offset + RECORD_HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < RECORD_HEADER:  # the block's tail is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + RECORD_HEADER])
        body = data[offset + RECORD_HEADER : offset + RECORD_HEADER + length]
        offset += RECORD_HEADER + length
        pending = body if kind in (FULL, FIRST) else pending + body
        if kind in (FULL, LAST):
            found.append(pending)
    return found


def history(run_dir: Path) -> list[dict[str, float]]:
    """Every history row of the offline runs under ``run_dir`` (<workdir>/wandb), in order."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for run_file in sorted(run_dir.glob("offline-run-*/run-*.wandb")):
        for raw in records(run_file):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows
