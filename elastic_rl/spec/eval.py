"""The ``eval`` section: held-out prompt sets generated and scored every few rollouts."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, PositiveInt, field_validator, model_validator

from elastic_rl.spec.base import Component, existing_file


class EvalSampling(Component):
    """How eval responses are sampled: greedily by default, so evals compare across rollouts."""

    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Sample from the k most likely tokens; -1 for all."""
    max_new_tokens: PositiveInt | None = None
    """Longest response; default rollout.max_new_tokens."""


class EvalDataset(Component):
    """A held-out prompt set, generated through the job's engines and scored by its reward."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    """Its metrics are eval/<name>/...: lower-case letters, digits, dashes and underscores."""
    path: Path
    """A JSONL file of prompts and labels (data.prompt_key, data.label_key), relative to the spec's folder."""
    n_samples_per_prompt: PositiveInt = 1
    """Responses generated per prompt."""
    sampling: EvalSampling = EvalSampling()

    _path_exists = field_validator("path")(existing_file)


class EvalSpec(Component):
    """Eval on held-out prompts every few rollouts; its metrics go to metrics.jsonl, never to training."""

    interval_rollouts: int = Field(0, ge=0)
    """Eval before every rollout whose id is a multiple of this (0, 10, 20, ... for 10); 0: never."""
    datasets: list[EvalDataset] = []

    @model_validator(mode="after")
    def _named_once(self) -> EvalSpec:
        names = [dataset.name for dataset in self.datasets]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"datasets: give each a different name (repeated: {', '.join(repeated)})")
        if self.interval_rollouts and not self.datasets:
            raise ValueError("interval_rollouts is set but datasets is empty: add a dataset or remove it")
        return self
