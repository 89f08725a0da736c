"""Where the orchestrator sends each rollout's metrics line besides metrics.jsonl: TensorBoard, or nowhere.

``metric_sink`` gives a ``TensorBoardSink`` when the spec asks for it, else a
``NoSink`` that does nothing, so the orchestrator never asks which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from elastic_rl.config import JobSpec

NOT_SCALARS = ("rollout", "time")


class MetricSink(Protocol):
    def write(self, line: dict[str, Any]) -> None: ...


class NoSink:
    def write(self, line: dict[str, Any]) -> None:
        pass


class TensorBoardSink:
    """Scalars under their metric names, the rollout as the step, the line's time as the wall time."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder))

    def write(self, line: dict[str, Any]) -> None:
        for name, value in line.items():
            if name not in NOT_SCALARS and isinstance(value, (int, float)):
                self.writer.add_scalar(name, value, global_step=line["rollout"], walltime=line["time"])
        self.writer.flush()


def metric_sink(spec: JobSpec, workdir: Path) -> MetricSink:
    return TensorBoardSink(workdir / "tensorboard") if spec.metrics.tensorboard else NoSink()
