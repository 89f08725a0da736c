"""The ``fault_tolerance`` section: quorum and collective timeouts, restart budgets, warm spares, the NaN and
straggler responses."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from elastic_rl.spec.base import Component
from policies.straggler import StragglerRule


class FaultToleranceSpec(Component):
    """How the job survives failures."""

    heartbeat_timeout_ms: PositiveInt = 1000
    """Lighthouse: a replica silent this long leaves the quorum (the survivors' stall)."""
    join_timeout_ms: PositiveInt = 100
    """Lighthouse: how long a forming quorum waits for healthy replicas that have not asked to join."""
    quorum_timeout_s: PositiveFloat = 60.0
    """torchft: how long a replica waits for a quorum."""
    collective_timeout_s: PositiveFloat = 60.0
    """torchft: timeout of a cross-replica all-reduce, a commit vote and a heal from a peer."""
    model_parallel_timeout_s: PositiveFloat = 300.0
    """Timeout of every collective inside one replica (tensor-parallel all-reduces and gathers, the
    snapshot group's coordination) and of its ranks' rendezvous: a rank waiting longer fails, and
    erld restarts its replica."""
    gpu_process_group: Literal["nccl", "baby_nccl"] = "nccl"
    """torchft's cross-replica group on GPU slots (gloo on CPU slots): nccl (torchft's
    ProcessGroupNCCL, which aborts a stuck communicator and recovers in process) or baby_nccl
    (ProcessGroupBabyNCCL: NCCL in a child process, so a dead peer cannot take the trainer down;
    it costs about 1 GB of GPU memory for the child's CUDA context, and communication no longer
    overlaps compute)."""
    max_restarts: int = Field(5, ge=0)
    """Restarts of one process allowed within restart_window_s before the job fails."""
    restart_window_s: PositiveFloat = 600.0
    """Window over which restarts are counted."""
    warm_spares: int = Field(0, ge=0)
    """Spare trainer processes kept with the model built, ready to replace a replica."""
    below_min_grace_s: PositiveFloat = 300.0
    """How long the job runs on without room for its minimum (of replicas or engines, or for its
    services) before it pauses: its processes stop as `erl stop` stops them (trainers snapshot), and
    it resumes by itself once the minimum fits again."""
    stop_grace_s: PositiveFloat = 30.0
    """How long `erl stop` waits for processes to exit (trainers finish the rollout in hand and snapshot)."""
    handover_timeout_s: PositiveFloat = 120.0
    """With ``placement: colocated``: how long an engine may take to release its memory before the
    trainers train, or to take it back after, and a trainer rank to load its state onto its device or
    offload it. A process that takes longer is taken for hung: it is killed and restarted, as any fault."""
    max_consecutive_nan_skips: PositiveInt = 3
    """Non-finite steps skipped in a row before rolling back to the newest snapshot."""
    straggler_factor: float | None = Field(2.0, gt=1.0)
    """A trainer replica whose own time per step (its forward and backward passes, outside the all-reduce)
    is at least this many times the median of its peers' is slow in that step; null: stragglers are never
    replaced. Two: healthy replicas' steps differ by far less, and a replica at half its peers' pace
    halves the whole job's (``policies.straggler``)."""
    straggler_steps: PositiveInt = 5
    """Slow this many committed steps in a row, a replica is a straggler: it leaves, its devices are
    marked failed, and a warm spare or a free device takes its place (or the job goes on with one
    replica fewer, above its minimum). With nowhere to go it trains on, and says so."""

    @property
    def straggler_rule(self) -> StragglerRule | None:
        """The straggler rule these fields make; None while straggler_factor is null."""
        if self.straggler_factor is None:
            return None
        return StragglerRule(factor=self.straggler_factor, steps=self.straggler_steps)
