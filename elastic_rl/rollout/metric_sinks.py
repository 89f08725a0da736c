"""Where the orchestrator sends each rollout's metrics line besides metrics.jsonl.

``metric_sinks`` gives one sink per switch the spec turns on: TensorBoard event
files, and Weights & Biases in offline mode. The orchestrator writes every
line to each and closes them at the end, never asking which they are.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

from elastic_rl.spec.job import JobSpec

NOT_SCALARS = ("rollout", "time")


class MetricSink(Protocol):
    def write(self, line: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(line: dict[str, Any]) -> dict[str, float]:
    return {name: value for name, value in line.items() if name not in NOT_SCALARS and isinstance(value, (int, float))}


class TensorBoardSink:
    """Scalars under their metric names, the rollout as the step, the line's time as the wall time."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder))

    def write(self, line: dict[str, Any]) -> None:
        for name, value in scalars(line).items():
            self.writer.add_scalar(name, value, global_step=line["rollout"], walltime=line["time"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbOfflineSink:
    """A W&B run in offline mode under <workdir>/wandb; `wandb sync` uploads it where a network is.

    The run id comes from the job and its work dir, so an orchestrator restarted
    mid-job resumes the same run rather than starting a second one.
    """

    def __init__(self, spec: JobSpec, workdir: Path):
        import wandb

        digest = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:8]
        # No console capture, system stats, git or code snapshot: the run holds the job's metrics only.
        settings = wandb.Settings(
            console="off", x_disable_stats=True, disable_git=True, save_code=False, x_disable_meta=True, silent=True
        )
        self.run = wandb.init(
            mode="offline",
            dir=str(workdir),
            project="elastic-rl",
            name=spec.name,
            id=f"{spec.name}-{digest}",
            resume="allow",
            config=spec.model_dump(mode="json"),
            settings=settings,
        )

    def write(self, line: dict[str, Any]) -> None:
        self.run.log(scalars(line), step=line["rollout"])

    def close(self) -> None:
        self.run.finish()


def metric_sinks(spec: JobSpec, workdir: Path) -> list[MetricSink]:
    sinks: list[MetricSink] = []
    if spec.metrics.tensorboard:
        sinks.append(TensorBoardSink(workdir / "tensorboard"))
    if spec.metrics.wandb_offline:
        sinks.append(WandbOfflineSink(spec, workdir))
    return sinks
