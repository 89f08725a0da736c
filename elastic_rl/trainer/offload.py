"""Colocated mode's trainer side of the handover: the training state leaves the device for the engines'
turn and comes back for the trainers'.

The order, with the orchestrator's side (``rollout.handover``): the engines generate a rollout and
release their memory before it is committed; a rank waits for the commit, then loads its state onto
the device (``onload``) and trains; after the rollout's last step it offloads (``offload``), writes
what each phase peaked at, and publishes the weights, which the engines resume to take.

On a GPU the parameters (the reference's, teacher's and critic's too), their gradients and the optimizers'
state (unless ``trainer.optimizer_offload`` keeps it there already: no optimizers given) move to host memory and the
caching allocator hands the freed blocks back to the driver; the engines sharing the device get that
room. On a CPU slot there is nowhere else to put them: both moves are
no-ops and only their place in the protocol, their timing and their timeout run.

Each move runs under ``fault_tolerance.handover_timeout_s``: a rank stuck in one longer than that logs
why and exits ``EXIT_HANDOVER_HUNG``, and erld restarts it as any fault (the replica heals from a peer
or resumes from its snapshot).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import orjson
import torch

from checkpoints import layout
from elastic_rl.atomic import write_file_atomic
from elastic_rl.phase_memory import Phase, PhasePeaks
from elastic_rl.trainer.watchdog import Watchdog
from policies.exits import EXIT_HANDOVER_HUNG

HOST = torch.device("cpu")


class Residency:
    """Where a rank's training state is, and the moves between the device and host memory."""

    def __init__(
        self,
        modules: Iterable[torch.nn.Module | None],
        optimizers: Iterable[torch.optim.Optimizer],
        device: torch.device,
        timeout_s: float,
        exit: Callable[[int], None] = os._exit,
        *,
        gradients: Callable[[torch.device], None] | None = None,
    ):
        """``gradients``, when given, moves the buffers the modules' gradients are views of (the trainer's,
        ``trainer.gradient_buffer``), which then leaves each ``.grad`` to it: a view moved on its own would
        become a tensor of its own, and the step would sum a buffer the backward pass no longer fills."""
        self.modules = [module for module in modules if module is not None]
        self.gradients = gradients
        self.optimizers = list(optimizers)
        self.device = device
        self.timeout_s = timeout_s
        self._exit = exit
        self.on_device = True
        self.peaks = PhasePeaks(Phase.TRAINING, cuda=device.type == "cuda")

    def onload(self) -> float:
        """Bring the state back onto the device for the trainers' turn; the seconds it took."""
        if self.on_device:
            return 0.0
        took = self._move(self.device, "loading the rank's state onto its device")
        self.on_device = True
        self.peaks.switch(Phase.TRAINING)
        return took

    def offload(self) -> float:
        """Move the state to host memory for the engines' turn; the seconds it took."""
        if not self.on_device:
            return 0.0
        took = self._move(HOST, "offloading the rank's state")
        self.on_device = False
        self.peaks.switch(Phase.GENERATION)
        return took

    def _move(self, where: torch.device, what: str) -> float:
        started = time.monotonic()
        with Watchdog(self.timeout_s, what, EXIT_HANDOVER_HUNG, exit=self._exit):
            if self.device.type != "cpu":  # on a CPU slot, host memory is the device
                self._move_tensors(where)
        return time.monotonic() - started

    def _move_tensors(self, where: torch.device) -> None:
        for module in self.modules:
            for param in module.parameters():
                param.data = param.data.to(where)
                if param.grad is not None and self.gradients is None:
                    param.grad = param.grad.to(where)
        if self.gradients is not None:
            self.gradients(where)
        for state in (state for optimizer in self.optimizers for state in optimizer.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):  # the moments, and the fused kernel's step counter
                    state[key] = value.to(where)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def write_peaks(self, workdir: Path, rollout_id: int, proc: str, node: str | None, slot: str | None) -> None:
        """Record what this rank peaked at in the engines' turn before ``rollout_id`` and in its training."""
        record = {
            "node": node,
            "slot": slot,
            **{f"{phase.value}_peak_bytes": peak for phase, peak in self.peaks.last.items()},
        }
        write_file_atomic(layout.phase_memory_path(workdir, rollout_id, proc), orjson.dumps(record))
