"""The peak memory of this process in each phase of colocated mode's turns, for the job's telemetry.

A colocated slot holds a trainer rank and an engine that take turns: while the engines generate the
trainer's state is offloaded, while the trainer trains the engine's memory is released. What colocation
saves is the gap between each process's own peak and the peak of the two together, so each process
measures its own, phase by phase, and the orchestrator adds them up per slot.

On a CPU slot the measure is the process's resident memory: Linux keeps its peak (``VmHWM``) and resets
it on request (writing 5 to ``/proc/self/clear_refs``), so no sampling is needed. On a GPU it is the
CUDA caching allocator's peak reservation, reset the same way at each phase change.
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_PEAK_RSS = "5"


class Phase(str, Enum):
    GENERATION = "generation"
    """The engines generate; the trainers' state is offloaded."""
    TRAINING = "training"
    """The trainers train; the engines' memory is released."""


class PhasePeaks:
    """The peak of each phase, as the phases change (``switch``)."""

    def __init__(self, phase: Phase, cuda: bool = False):
        self.phase = phase
        self.cuda = cuda
        self.last: dict[Phase, int] = {}
        """Each phase's peak in bytes, the last time it ended."""
        self._reset()

    def switch(self, phase: Phase) -> None:
        """End the current phase (its peak is kept in ``last``) and start ``phase``."""
        self.last[self.phase] = self._peak()
        self.phase = phase
        self._reset()

    def _peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_reserved()
        kilobytes = re.search(r"VmHWM:\s+(\d+) kB", STATUS.read_text())
        return int(kilobytes.group(1)) * 1024 if kilobytes else 0

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            CLEAR_REFS.write_text(RESET_PEAK_RSS)
        except OSError:
            pass  # a kernel without it (before 4.0): peaks then run from the process's start
