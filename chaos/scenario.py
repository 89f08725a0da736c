"""A chaos scenario: the job, the machines it runs on, and the faults to inject when.

A scenario is YAML, validated like a job spec (unknown keys and bad values are
named with their field, exit 2):

    name: engine-hang
    job: ../../examples/tiny-grpo.yaml        # relative to this file
    overrides: [rollout.num_rollouts=8, engines.count=1]
    topology: {nodes: 1, cpu_devices: 8}
    seed: 0
    faults:
      - {kind: hang, target: engine-0, at: {rollout: 3}, duration_s: 20}
    weights_tolerance: 0.0                     # 0: bitwise equal to the fault-free run
    expect_events: [engine_unhealthy]          # what the faults must cause

A fault fires at a rollout (once that many are trained), at a time after the
job started, or at a random rollout within a window (drawn from the seed),
a random part of a second later so it lands anywhere in a rollout.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from elastic_rl.errors import SpecError
from elastic_rl.event_kinds import EventKind
from elastic_rl.spec.loading import read_spec_file


class FaultKind(Enum):
    KILL = "kill"
    """SIGKILL a job process: a name (trainer-1-0), a role (trainer, engine, ...) or `any`."""
    HANG = "hang"
    """SIGSTOP a job process for duration_s, then SIGCONT."""
    SLOW_ENGINE = "slow_engine"
    """SIGSTOP an engine in bursts (burst_s every period_s) for duration_s."""
    SLOW_TRAINER = "slow_trainer"
    """SIGSTOP every rank of one trainer replica (target: its index) in bursts (burst_s every period_s) for
    duration_s: a straggler, slow but alive."""
    KILL_DEVICE = "kill_device"
    """Kill every process on a device slot (a process's, or node/slot) and mark it failed for duration_s."""
    KILL_ERLD = "kill_erld"
    """SIGKILL a node's erld (`leader`, or a node name) and start it again at once, as systemd would."""
    KILL_NODE = "kill_node"
    """A whole node dies: its erld and every process it started (`services`, `leader`, a node name, or the node
    of a named process)."""
    PARTITION = "partition"
    """Cut a node off from etcd for duration_s (target as for kill_node): its erld
    and every process it started lose etcd, and still reach the other nodes' processes."""
    KILL_ETCD_MEMBER = "kill_etcd_member"
    """SIGKILL one member of a several-member etcd (target: its index), and start it again, its data kept,
    duration_s later. Two of three killed together: etcd has lost its quorum until they come back."""
    CORRUPT_SNAPSHOT = "corrupt_snapshot"
    """Flip bytes in the newest committed snapshot's data; the next resume must skip it."""
    FILL_DISK = "fill_disk"
    """Fill the work dir's filesystem (a tmpfs the scenario mounts) for duration_s, then free it."""
    NAN = "nan"
    """Non-finite losses at chosen optimizer steps, on one replica (target: its index) or in the data."""
    SCALE_ENGINES = "scale_engines"
    """Not a fault but what an operator does meanwhile: `erl scale` the job to target engines."""
    DRAIN = "drain"
    """`erl drain` of a node (target as for kill_node), with ``duration_s`` as its deadline: its work leaves
    at safe points; the erld stays."""
    PREEMPT = "preempt"
    """A preemption: SIGTERM to the node's erld, which drains its node on it (``topology.drain_on_term_s``,
    `erl daemon --drain-on-term`), then the whole node SIGKILLed ``duration_s`` later, whatever is left."""
    JOIN_NODE = "join_node"
    """Not a fault but capacity appearing: a new erld joins with target device slots (default: as
    many as the first node's)."""


class NanModel(Enum):
    """Whose loss a `nan` fault makes non-finite (the trainer's ``nan_injection.PoisonedModel``, by value)."""

    POLICY = "policy"
    CRITIC = "critic"
    """A PPO job's critic: its value loss."""


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class During(Enum):
    GENERATION = "generation"
    TRAINING = "training"


class At(Scenario):
    rollout: int | None = Field(None, ge=0)
    """Once this many rollouts are trained."""
    during: During | None = None
    """With rollout N: instead, while rollout N is generated (the orchestrator has begun it) or trained
    (committed, its training not yet published): for a colocated job, which of the two turns it hits."""
    tokens: int | None = Field(None, ge=1)
    """With during: generation: once the rollout's samples have streamed this many tokens in all (its
    in-flight log holds them) and some are still generating, so a fault lands that far into it."""
    seconds: float | None = Field(None, ge=0)
    """This long after the job started."""
    between: tuple[int, int] | None = None
    """At a random rollout in [first, last], drawn from the scenario's seed."""

    @model_validator(mode="after")
    def _one_moment(self) -> At:
        if sum(value is not None for value in (self.rollout, self.seconds, self.between)) != 1:
            raise ValueError("give exactly one of rollout, seconds or between")
        if self.during is not None and self.rollout is None:
            raise ValueError("during names a phase of one rollout: give it with rollout")
        if self.tokens is not None and self.during is not During.GENERATION:
            raise ValueError("tokens counts a rollout's generation: give it with during: generation")
        return self


class Fault(Scenario):
    kind: FaultKind
    target: str | int | None = None
    at: At | None = None
    """When (in a scenario file; a `nan` fault instead names its optimizer steps)."""
    duration_s: float = Field(10.0, gt=0)
    burst_s: float = Field(2.0, gt=0)
    period_s: float = Field(5.0, gt=0)
    steps: list[int] = []
    """nan: the optimizer steps (counted from 0 over the run) that produce NaN."""
    attempts: int = Field(0, ge=0)
    """nan: how many tries of each step produce NaN; 0: every try (a persistent fault)."""
    model: NanModel = NanModel.POLICY
    """nan: whose loss is non-finite: the policy's, or (a PPO job's) the critic's value loss."""

    @model_validator(mode="after")
    def _when(self) -> Fault:
        if self.kind is FaultKind.NAN and (not self.steps or self.at is not None):
            raise ValueError("a nan fault names its steps, not `at`")
        return self


class Topology(Scenario):
    nodes: int = Field(1, ge=1)
    cpu_devices: int = Field(8, ge=1)
    etcd_members: int = Field(1, ge=1)
    """1: the first erld's embedded etcd; more: an etcd cluster of that many members."""
    lease_ttl_s: int = Field(4, ge=1)
    workdir_tmpfs_mb: int | None = Field(None, gt=0)
    """Put the work dir on a tmpfs of this size (for fill_disk)."""
    pool: dict[str, int] | None = None
    """Pre-imported interpreters each erld keeps per process kind (`erl daemon --pool`); None: erld's defaults."""
    drain_on_term_s: float | None = Field(None, gt=0)
    """Each erld drains its node on SIGTERM within this many seconds (`erl daemon --drain-on-term`)."""


class ChaosScenario(Scenario):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    description: str = ""
    job: Path
    overrides: list[str] = []
    topology: Topology = Topology()
    seed: int = 0
    faults: list[Fault] = Field(min_length=1)
    weights_tolerance: float | None = Field(0.0, ge=0)
    """Largest relative difference of any weight to the fault-free run's; 0 is bitwise; null: not
    compared, for faults that change what is trained (a batch quarantined as bad data)."""
    timeout_s: float = Field(900.0, gt=0)
    expect_events: list[EventKind] = []
    """Event kinds the faults must cause, each at least once (a straggler found, say): a fault the job
    never noticed tested nothing."""
    nothing_redone: bool = False
    """The faults leave time enough to hand work over (a drain or preemption with a long notice), or should
    cost no restart at all (an etcd outage): checked too that nothing was redone (no resume from a
    snapshot, no crash, nothing taken at a deadline)."""

    @model_validator(mode="after")
    def _fits_the_topology(self) -> ChaosScenario:
        for fault in self.faults:
            if fault.kind is not FaultKind.NAN and fault.at is None:
                raise ValueError(f"a {fault.kind.value} fault needs `at`")
            if fault.kind is FaultKind.KILL_ETCD_MEMBER and self.topology.etcd_members < 3:
                raise ValueError("kill_etcd_member needs topology.etcd_members >= 3 (a quorum must survive)")
            node_faults = (FaultKind.KILL_NODE, FaultKind.DRAIN, FaultKind.PREEMPT, FaultKind.PARTITION)
            if fault.kind in node_faults and self.topology.nodes < 2:
                raise ValueError(f"{fault.kind.value} needs topology.nodes >= 2 (the work must go somewhere)")
            if fault.kind is FaultKind.PREEMPT and self.topology.drain_on_term_s is None:
                raise ValueError("preempt needs topology.drain_on_term_s (the erlds drain on SIGTERM)")
            if fault.kind is FaultKind.FILL_DISK and self.topology.workdir_tmpfs_mb is None:
                raise ValueError("fill_disk needs topology.workdir_tmpfs_mb")
        return self

    @property
    def partitionable(self) -> bool:
        """Each node reaches etcd through a proxy of its own, which a `partition` fault cuts."""
        return any(fault.kind is FaultKind.PARTITION for fault in self.faults)

    @property
    def nan_injection(self) -> dict | None:
        """The `nan` fault as the trainer reads it from ERL_INJECT_NAN, if there is one."""
        nan = next((f for f in self.faults if f.kind is FaultKind.NAN), None)
        if nan is None:
            return None
        return {"steps": nan.steps, "replica": nan.target, "attempts": nan.attempts, "model": nan.model.value}


def load_scenario(path: Path) -> ChaosScenario:
    data = read_spec_file(path)
    try:
        scenario = ChaosScenario.model_validate(data)
    except ValidationError as exc:
        raise SpecError(
            [
                f"{path}: {'.'.join(str(p) for p in e['loc']) or 'scenario'}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors()
            ]
        ) from None
    job = scenario.job if scenario.job.is_absolute() else (path.parent / scenario.job).resolve()
    if not job.is_file():
        raise SpecError([f"{path}: job: no job spec at {job}"])
    return scenario.model_copy(update={"job": job})
