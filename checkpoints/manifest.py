"""The commit protocol: a folder counts only once its manifest, written last, vouches for it.

``write_manifest`` records every file's size and sha256 plus the caller's
fields, through a temp file, fsync, atomic rename and a directory fsync.
``verify`` re-reads the folder and says why it is not valid, or None: a missing
or unreadable manifest, a missing file, a size or checksum mismatch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson

from elastic_rl.atomic import write_file_atomic

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _content_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))


def write_manifest(folder: Path, fields: dict[str, Any]) -> dict[str, Any]:
    files = {
        str(path.relative_to(folder)): {"size": path.stat().st_size, "sha256": file_digest(path)}
        for path in _content_files(folder)
    }
    manifest = {**fields, "files": files}
    write_file_atomic(folder / MANIFEST, orjson.dumps(manifest, option=orjson.OPT_SORT_KEYS))
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return orjson.loads((folder / MANIFEST).read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None


def verify(folder: Path) -> str | None:
    """Why ``folder`` is not a committed, intact folder; None when it is."""
    manifest = read_manifest(folder)
    if manifest is None:
        return "no valid manifest (the save never finished)"
    for name, expected in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['size']}"
        if file_digest(path) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None
