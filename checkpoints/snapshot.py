"""Snapshots of a trainer replica's state, written with torch.distributed.checkpoint (DCP).

A snapshot holds the model, the AdamW state, the LR scheduler's position, the
RNG state, the optimizer step and the id of the last rollout applied, every
value a tensor; with PPO, the critic's model, AdamW state and scheduler
position too, under ``critic.``. Each tensor-parallel rank contributes its own slices as
DTensors over the TP mesh, described in the TP=1 layout (the gated MLP's
``linear_fc1`` is saved as separate ``gate`` and ``up`` halves), so DCP can
load a snapshot taken at one TP size into a model built at another. A
replica's data-parallel ranks hold the same weights (DCP writes each once);
with the optimizer sharded across them, each rank saves the moments of the
parameters it owns, under those parameters' names, so a snapshot loads at
any data-parallel size, sharded or not. Pipeline stages save their layers under
the whole model's names (``elastic_rl.layer_names``), so a snapshot also loads
at another pipeline size. A model held in bf16 (``trainer.dtype: bf16-params``) saves its fp32 main
weights and moments in its parameters' place, gathered whole, so its snapshots load at any dtype. Loading
unpickles nothing beyond DCP's own metadata types (``checkpoints.safe_reader``).

Saving is asynchronous by default: a background thread copies the tensors
into a reused staging buffer, then writes them with DCP over a process group
of its own, and rank 0 commits the snapshot by writing its manifest last
(``checkpoints.manifest``). Only the optimizer step changes what is copied, so
the training loop goes on (waiting for the next rollout, forward, backward)
and blocks, at ``wait_staged()`` before its next optimizer step, only if the
copy is not done by then. The staging buffer is in CPU memory (pinned, for a
model on a GPU), and a snapshot is loaded through CPU tensors too, so DCP and
its gloo group only ever see CPU tensors. DCP's own
``async_save`` stager fails on CPU-only builds of torch 2.13 ("invalid python
storage"), hence the thread.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from checkpoints.layout import snapshot_path
from checkpoints.manifest import verify, write_manifest
from checkpoints.safe_reader import SafeFileSystemReader
from elastic_rl.architecture import GATED_FC1_SUFFIX
from elastic_rl.layer_names import whole_model_parameters

log = logging.getLogger("checkpoints.snapshot")

ADAM_STATES = ("exp_avg", "exp_avg_sq")


class MainWeights(Protocol):
    """fp32 weights and AdamW state kept apart from a bf16 model (``trainer.dtype: bf16-params``), whole per
    parameter for a snapshot: {"weight"}, with {"exp_avg", "exp_avg_sq", "step"} once it has stepped."""

    def whole(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]: ...

    def ensure_moments(self) -> None: ...

    def load_whole(self, param: torch.nn.Parameter, whole: dict[str, torch.Tensor]) -> None: ...


@dataclass
class TrainingState:
    """The live objects a snapshot is taken from and restored into."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | MainWeights
    scheduler: torch.optim.lr_scheduler.LRScheduler
    main_weights: MainWeights | None = None
    """With bf16 parameters: what holds their fp32 weights and moments, saved in their place."""
    optimizer_on_host: bool = False
    """AdamW's state lives in host memory (``trainer.optimizer_offload``), wherever the parameters are."""
    critic: TrainingState | None = None
    """PPO's critic, trained beside the model (``algorithm.critic``)."""

    def parts(self) -> list[tuple[str, TrainingState]]:
        """(prefix of its snapshot entries, state) of the model and of the critic, if any."""
        return [("", self), *([("critic.", self.critic)] if self.critic is not None else [])]


def tp_mesh() -> DeviceMesh:
    return DeviceMesh.from_group(parallel_state.get_tensor_model_parallel_group(), "cpu", mesh_dim_names=("tp",))


# How a local tensor lies in the TP=1 layout: replicated on every TP rank, or sharded along a dim.
REPLICATED = -1


def _slices(name: str, param: torch.nn.Parameter, tensor: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    """``tensor`` (this rank's slice of ``param``, or its Adam state) as named (slice, placement) pairs."""
    if not getattr(param, "tensor_model_parallel", False):
        return {name: (tensor, REPLICATED)}
    if name.endswith(GATED_FC1_SUFFIX):
        gate, up = tensor.chunk(2, dim=0)
        return {f"{name}.gate": (gate, 0), f"{name}.up": (up, 0)}
    return {name: (tensor, param.partition_dim)}


def _local_entries(
    state: TrainingState, step: int, last_rollout: int, wholes: dict | None = None
) -> dict[str, tuple[torch.Tensor, int | None]]:
    """Every value of a snapshot as (tensor aliasing the live one, placement); None: a plain tensor.
    With main weights, their whole tensors are noted in ``wholes`` by parameter, for a load to give back."""
    entries: dict[str, tuple[torch.Tensor, int | None]] = {
        "meta.step": (torch.tensor(step), None),
        "meta.last_rollout": (torch.tensor(last_rollout), None),
        "meta.rng_cpu": (torch.get_rng_state(), None),
    }
    for prefix, part in state.parts():
        entries[f"{prefix}meta.scheduler_epoch"] = (torch.tensor(part.scheduler.last_epoch), None)
        entries.update({f"{prefix}{name}": entry for name, entry in _model_entries(part, wholes).items()})
    return entries


def _model_entries(state: TrainingState, wholes: dict | None) -> dict[str, tuple[torch.Tensor, int | None]]:
    """One model's weights and AdamW state as snapshot entries."""
    entries: dict[str, tuple[torch.Tensor, int | None]] = {}
    for name, param in whole_model_parameters(state.model):
        if state.main_weights is None:
            weights, adam = param.data, state.optimizer.state.get(param)
        else:
            whole = state.main_weights.whole(param)
            weights, adam = whole["weight"], whole if "step" in whole else None
            if wholes is not None:
                wholes[param] = whole
        entries.update({f"model.{k}": v for k, v in _slices(name, param, weights).items()})
        if adam:
            entries[f"optim.{name}.step"] = (adam["step"], None)
            for key in ADAM_STATES:
                entries.update({f"optim.{k}.{key}": v for k, v in _slices(name, param, adam[key]).items()})
    return entries


def _dcp_entries(local: dict[str, tuple[torch.Tensor, int | None]], mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """The DCP state dict: sharded and replicated slices as DTensors over the TP mesh."""
    entries = {}
    for name, (tensor, placement) in local.items():
        if placement is None:
            entries[name] = tensor
        else:
            layout = [Replicate()] if placement == REPLICATED else [Shard(placement)]
            entries[name] = DTensor.from_local(tensor, mesh, layout, run_check=False)
    return entries


class SnapshotWriter:
    """Takes snapshots of one replica; at most one save in flight."""

    def __init__(
        self, workdir: Path, async_save: bool, on_committed=None, on_failed=None, timeout: timedelta | None = None
    ):
        self.workdir = workdir
        self.async_save = async_save
        self.on_committed = on_committed or (lambda step, path: log.info("snapshot %d committed: %s", step, path))
        self.on_failed = on_failed or (lambda step, error: log.error("snapshot %d failed: %r", step, error))
        # DCP's background writes coordinate on a group of their own, apart from training's collectives.
        self.group = torch.distributed.new_group(backend="gloo", timeout=timeout)
        self.mesh = tp_mesh()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self.pending: Future | None = None
        # Reused between saves: copying into memory already touched avoids a page fault per 4 KiB.
        self.staging: dict[str, torch.Tensor] = {}
        self.staged = threading.Event()
        self.staged.set()
        self.last_wait_s = 0.0

    def save(
        self, state: TrainingState, step: int, last_rollout: int, spec_hash: str, writer: dict | None = None
    ) -> None:
        """Start a snapshot of ``state`` after rollout ``last_rollout``. ``writer``: which process instance
        writes it (its name and assignment generation), recorded in the manifest for the one-writer check.

        With ``async_save`` this returns at once: the copy and the write run in the
        background, and the caller must call ``wait_staged()`` before it next changes
        the state (the optimizer step), so the copy sees the state of this moment.
        """
        started = time.monotonic()
        self.wait()
        self.last_wait_s = time.monotonic() - started
        path = snapshot_path(self.workdir, step)
        if not self._should_write(path):
            return  # a replayed step whose snapshot was already committed
        live = _local_entries(state, step, last_rollout)
        fields = {"step": step, "last_rollout": last_rollout, "spec_hash": spec_hash}
        if writer is not None:
            fields["writer"] = writer
        self.staged = threading.Event()
        if self.async_save:
            self.pending = self.executor.submit(self._stage_and_write, live, path, fields)
        else:
            self._stage_and_write(live, path, fields)

    def _should_write(self, path: Path) -> bool:
        """Rank 0 looks at ``path`` and decides for every TP rank.

        Each rank looking for itself could disagree: a rank whose save starts
        first creates the folder, and one that looks after it would take it for
        a killed save's remains, clear it and wait at a barrier its peer never
        reaches (the fault-free TP=2 job hung so).
        """
        decision = [True]
        if torch.distributed.get_rank() == 0 and path.exists():
            if verify(path) is None:
                decision = [False]
            else:
                shutil.rmtree(path)  # the remains of a save that was killed
        torch.distributed.broadcast_object_list(decision, group=self.group, group_src=0)
        return decision[0]

    def wait_staged(self) -> float:
        """Block until the snapshot in flight has copied the state; return the seconds blocked."""
        started = time.monotonic()
        self.staged.wait()
        return time.monotonic() - started

    def _stage(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self.staging.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.staging[name] = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
        return buffer.copy_(tensor)

    def _stage_and_write(self, live: dict[str, tuple[torch.Tensor, int | None]], path: Path, fields: dict) -> None:
        try:
            try:
                staged = {name: (self._stage(name, tensor), placement) for name, (tensor, placement) in live.items()}
            finally:
                self.staged.set()
            dcp.save(_dcp_entries(staged, self.mesh), checkpoint_id=str(path), process_group=self.group)
            self._commit(path, fields)
        except (Exception, dcp.CheckpointException) as exc:  # CheckpointException is a BaseException
            if torch.distributed.get_rank() == 0:
                # Never valid without a manifest; removing it gives a full disk its room back.
                shutil.rmtree(path, ignore_errors=True)
            self.on_failed(fields["step"], exc)

    def _commit(self, path: Path, fields: dict) -> None:
        if torch.distributed.get_rank() == 0:
            write_manifest(path, fields)
            self.on_committed(fields["step"], path)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()  # _write reports its own failures and never raises


def load_snapshot(state: TrainingState, path: Path, group: torch.distributed.ProcessGroup) -> tuple[int, int]:
    """Restore ``state`` from the snapshot at ``path`` (any TP size); return (step, last_rollout).
    ``group``: the gloo group DCP coordinates over (the ``SnapshotWriter``'s), never the replica's
    default group, which is NCCL's on a GPU."""
    for _, part in state.parts():
        _ensure_moments(part)
    wholes: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    live = _local_entries(state, step=0, last_rollout=0, wholes=wholes)
    # A GPU tensor is loaded through a CPU twin, then copied in.
    targets = {name: (_on_cpu(tensor), placement) for name, (tensor, placement) in live.items()}
    entries = _dcp_entries(targets, tp_mesh())
    dcp.load(entries, storage_reader=SafeFileSystemReader(str(path)), process_group=group)
    for name, (tensor, _) in live.items():
        if tensor is not targets[name][0]:
            tensor.copy_(targets[name][0])
    for param, whole in wholes.items():
        state.main_weights.load_whole(param, whole)
    torch.set_rng_state(entries["meta.rng_cpu"])
    for prefix, part in state.parts():
        _sync_scheduler(part.scheduler, int(entries[f"{prefix}meta.scheduler_epoch"]))
    return int(entries["meta.step"]), int(entries["meta.last_rollout"])


def _ensure_moments(state: TrainingState) -> None:
    """Give every parameter this rank's optimizer updates its AdamW state, for a load to fill (sharded, the
    others' state is another rank's)."""
    if state.main_weights is not None:
        state.main_weights.ensure_moments()
        return
    for param in (param for group in state.optimizer.param_groups for param in group["params"]):
        if param not in state.optimizer.state:
            # On the parameter's device, as AdamW makes it (the fused CUDA kernel refuses a step counter in
            # CPU memory: seen on an H100, every resume's first step failed), or in host memory, offloaded.
            where = torch.device("cpu") if state.optimizer_on_host else param.device
            state.optimizer.state[param] = {
                "step": torch.zeros((), dtype=torch.float32, device=where),
                **{key: torch.zeros_like(param.data, device=where) for key in ADAM_STATES},
            }


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is in CPU memory, else an empty CPU tensor of its shape and dtype."""
    return tensor if tensor.device.type == "cpu" else torch.empty_like(tensor, device="cpu")


def _sync_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, epoch: int) -> None:
    """Put a LambdaLR back at ``epoch`` with the learning rates it had there."""
    scheduler.last_epoch = epoch
    for group, base_lr, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * fn(epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
