"""Hands a trained rollout to the engines: HF weights for version rollout + 1, and the rollout's metrics.

The step's participant 0 publishes. Every replica gathers the weights, as they
all hold the same ones, so that if the publisher died between its commit and
its export, another replica's rank 0 writes the missing version while it waits
for the next rollout (no collective is needed there). With
``engines.weight_sync: distributed`` the publisher first broadcasts a new
version into the engines (``trainer.weight_broadcast``); with ``memory`` (colocated) every
replica's rank 0 first puts it in its node's shared memory, which the engines load at once. The disk
copy is written either way: a restarted engine and a warm start read it.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import orjson
import torch

from checkpoints import layout
from checkpoints.retention import prune_weights
from elastic_rl.atomic import write_file_atomic
from elastic_rl.event_kinds import EventKind
from elastic_rl.events import emit_event
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.job import JobSpec
from elastic_rl.trainer.weight_broadcast import WeightBroadcaster

log = logging.getLogger("elastic_rl.trainer")


class RolloutPublisher:
    def __init__(
        self,
        spec: JobSpec,
        workdir: Path,
        model: torch.nn.Module,
        source: ModelSource,
        broadcaster: WeightBroadcaster | None = None,
        proc: str = "trainer",
    ):
        self.spec, self.workdir, self.model, self.source = spec, workdir, model, source
        self.broadcaster, self.proc = broadcaster, proc
        self.rank0 = torch.distributed.get_rank() == 0
        self.pending: tuple[int, dict, dict] | None = None
        self.pending_since = 0.0
        self.takeover_after_s = 2 * spec.fault_tolerance.heartbeat_timeout_ms / 1000 + 1.0

    def gather(self) -> dict[str, torch.Tensor]:
        """The whole model's weights: every TP rank takes part; rank 0's are the ones written."""
        return full_state_dict(self.model)

    def publish(self, rollout_id: int, metrics: dict, exporter: bool, weights: dict | None = None) -> None:
        """Publish (the exporter) or keep for a takeover the weights after ``rollout_id``: ``weights`` as
        ``gather`` made them, or gathered now."""
        weights = self.gather() if weights is None else weights
        if not self.rank0:
            return
        if self.spec.engines.weight_sync == "memory":
            metrics = {**metrics, **self._put_in_memory(layout.version_after(rollout_id), weights, exporter)}
        if exporter:
            self._write(rollout_id, weights, {**metrics, **self._broadcast(layout.version_after(rollout_id), weights)})
        else:
            self.pending, self.pending_since = (rollout_id, weights, metrics), time.monotonic()

    def take_over_if_missing(self) -> None:
        """Called while waiting for the next rollout: publish what the leader did not."""
        if self.pending is None or time.monotonic() - self.pending_since < self.takeover_after_s:
            return
        rollout_id, weights, metrics = self.pending
        self.pending = None
        version = layout.version_after(rollout_id)
        if not layout.weights_dir(self.workdir, version).exists():
            log.warning("weights %d were not published by the leader; publishing them", version)
            self._write(rollout_id, weights, metrics)

    def _broadcast(self, version: int, weights: dict) -> dict[str, float]:
        """Push a new version into the engines over NCCL, when the job asks for it; a replayed one is not new."""
        if self.broadcaster is None or version <= (layout.latest_weights_version(self.workdir) or 0):
            return {}
        started = time.monotonic()
        took, failure = self.broadcaster.push(version, self.source.hf_state(weights))
        spent = time.monotonic() - started
        if failure is not None:
            emit_event(
                EventKind.WEIGHT_BROADCAST_FAILED,
                f"weights {version}: {failure}; the engines load them from disk",
                self.proc,
                version=version,
            )
        return {"train/broadcast_time": spent, "train/broadcast_engines": float(len(took))}

    def _put_in_memory(self, version: int, weights: dict, exporter: bool) -> dict[str, float]:
        """Put a new version in this node's shared memory, where the colocated engines load it from without
        waiting for the disk export (every replica's rank 0 does, so every node of the job has it); the
        exporter then says so in the work dir. The previous version stays: an engine resuming its memory
        reloads the version it last served."""
        if version <= (layout.latest_weights_version(self.workdir) or 0):
            return {}  # a replayed rollout: its version is out already
        started = time.monotonic()
        self._export_once(layout.memory_weights_dir(self.workdir, version), weights)
        for older in layout.memory_weights_root(self.workdir).iterdir():
            if older.name.isdigit() and int(older.name) < version - 1:
                shutil.rmtree(older, ignore_errors=True)
        if exporter:
            write_file_atomic(layout.memory_weights_marker(self.workdir, version), b"")
        return {"train/memory_publish_time": time.monotonic() - started}

    def _export_once(self, target: Path, weights: dict) -> None:
        """Export ``weights`` to ``target`` unless another replica has (its atomic rename came first)."""
        if target.exists():
            return
        try:
            self.source.export(target, weights)
        except OSError:
            if not target.exists():
                raise  # not another replica's export of the same version: a real failure

    def _write(self, rollout_id: int, weights: dict, metrics: dict) -> None:
        version = layout.version_after(rollout_id)
        target = layout.weights_dir(self.workdir, version)
        # A replayed rollout reproduces weights exported before: kept, or pruned as no longer needed.
        if not target.exists() and version > (layout.latest_weights_version(self.workdir) or 0):
            started = time.monotonic()
            self._export_once(target, weights)
            metrics = {**metrics, "train/export_time": time.monotonic() - started}
        write_file_atomic(layout.train_metrics_path(self.workdir, rollout_id), orjson.dumps(metrics))
        # Async engines load a version max_staleness behind the newest (and buffered groups wait as long):
        # it must outlive that many exports.
        keep = max(self.spec.checkpoints.keep_weights, self.spec.rollout.staleness_bound + 1)
        prune_weights(self.workdir, keep, self.spec.engines.startup_timeout_s)
        log.info("rollout %d trained: weights version %d %s", rollout_id, version, metrics)
