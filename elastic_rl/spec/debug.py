"""The ``debug`` section: run one side of a job alone."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationInfo, field_validator, model_validator

from elastic_rl.spec.base import Component, from_spec_folder


class DebugSpec(Component):
    """Run one side of a job alone, to debug it (slime's debug rollouts)."""

    rollout_only: bool = False
    """Generate and commit rollouts without training: no trainer starts and the engines keep the
    initial weights."""
    train_only: Path | None = None
    """Train on the rollout log of an earlier job's work dir, generating nothing: no engine starts."""

    @field_validator("train_only")
    @classmethod
    def _a_folder(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is None:
            return None
        path = from_spec_folder(value, info)
        if not path.is_dir():
            raise ValueError(f"no folder {path}: give the work dir of a job whose rollout log to train on")
        return path.resolve()

    @model_validator(mode="after")
    def _one_side(self) -> DebugSpec:
        if self.rollout_only and self.train_only is not None:
            raise ValueError("rollout_only and train_only leave nothing to run together: set one of them")
        return self
