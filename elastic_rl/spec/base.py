"""What every section of the spec shares: the frozen, strict base model and the path checks.

A relative path in a spec is taken from the spec file's folder (the loader passes it as the
validation context's ``base_dir``), so a spec can be validated from any working directory.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationInfo

from elastic_rl.architecture import CONFIG_FILE


class Component(BaseModel):
    """Base of every spec model: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def from_spec_folder(value: Path, info: ValidationInfo) -> Path:
    """A relative path is taken from the spec's folder."""
    base = (info.context or {}).get("base_dir")
    return value if value.is_absolute() or base is None else Path(base) / value


def existing_file(value: Path | None, info: ValidationInfo) -> Path | None:
    """Resolve a path against the spec's folder and insist that it is a non-empty file."""
    if value is None:
        return None
    path = from_spec_folder(value, info)
    if not path.is_file():
        raise ValueError(f"file not found: {path}; give the path of an existing file")
    if path.stat().st_size == 0:
        raise ValueError(f"file is empty: {path}")
    return path.resolve()


def existing_checkpoint(value: Path | None, info: ValidationInfo) -> Path | None:
    """Resolve a checkpoint folder against the spec's folder and insist on its config.json."""
    if value is None:
        return None
    path = from_spec_folder(value, info)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"no HF checkpoint at {path} (no {CONFIG_FILE}); give a folder with config.json, safetensors "
            f"and tokenizer files, e.g. one made by `erl model import`"
        )
    return path.resolve()
