"""The ``metrics`` section: where each rollout's metrics go besides metrics.jsonl and `erl status`."""

from __future__ import annotations

import importlib.util

from pydantic import ValidationInfo, field_validator

from elastic_rl.spec.base import Component


class MetricsSpec(Component):
    """Where each rollout's metrics go besides metrics.jsonl and `erl status`."""

    tensorboard: bool = False
    """Also write them as TensorBoard event files in <workdir>/tensorboard (`tensorboard --logdir`)."""
    wandb_offline: bool = False
    """Also log them to a Weights & Biases run in offline mode in <workdir>/wandb (`wandb sync` uploads it)."""

    @field_validator("tensorboard", "wandb_offline")
    @classmethod
    def _writer_installed(cls, value: bool, info: ValidationInfo) -> bool:
        package = {"tensorboard": "tensorboard", "wandb_offline": "wandb"}[info.field_name]
        if value and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"metrics.{info.field_name} is on but {package} is not installed here; "
                "install it with `pip install 'elastic-rl[metrics]'`, or turn the switch off"
            )
        return value
