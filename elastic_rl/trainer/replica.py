"""One rank of one trainer replica (tensor x pipeline x data-parallel), stepping through the training protocol by name.

It builds the Megatron model on the device erld assigned it (the device
rule: a GPU, or a CPU slot; ``elastic_rl.device``) and joins the job's torchft
quorum through a Manager (even with one replica), over gloo on CPU and NCCL
(``fault_tolerance.gpu_process_group``) on a GPU. Its position in the run is the Manager's
step: rollout = step // steps_per_rollout. For each step it waits for the
orchestrator to commit that rollout, starts a quorum (a replica that is
behind heals from a peer here, taking its weights, optimizer, schedule and
the rollout in hand), and trains the step. After a rollout's last step the
step's participant 0 exports ``weights/<rollout + 1>`` for the engines with the
metrics beside them (``trainer.publisher``), and every
``checkpoints.interval_rollouts`` a snapshot.

Resume needs no flag: on start it restores the newest valid snapshot (an
invalid one is skipped with an event) and replays the committed rollouts
after it, which are still in the log; with no snapshot it replays from the
initial weights, which the seed determines. A replica that joins running
peers skips the replay: the quorum heals it.

A warm spare first waits for a replica's place (``trainer.warm_spare``); the
NaN/Inf guard's responses that outlive a step end the process with an exit
code erld acts on (``trainer.nan_response``), and so does a straggler's
leaving (``trainer.straggler_response``).

A replica on a draining node leaves after its rollout's last step: the
assignment check before publishing says so, it publishes, waits for its
snapshot and exits ``EXIT_DRAINED``; the survivors' next quorum goes on without
it and no step is redone. When the services move off a draining node, the
lighthouse moves too: each rollout records the lighthouse of the orchestrator
that committed it, and a replica whose lighthouse is not the one a newly
committed rollout names makes its Manager again against that one, keeping its
model, optimizer and step in memory. Every replica switches at the same
rollout, the first the new orchestrator commits: until then they train on the
old lighthouse, which its node keeps running (``daemon.agent``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
from torchft import Manager, ProcessGroupBabyNCCL, ProcessGroupGloo, ProcessGroupNCCL

from checkpoints import layout
from checkpoints.discovery import SnapshotInfo, newest_valid_snapshot
from checkpoints.retention import apply_retention
from checkpoints.rollout_log import read_meta, read_rollout
from checkpoints.snapshot import SnapshotWriter, TrainingState, load_snapshot
from elastic_rl import device as process_device
from elastic_rl import jobenv
from elastic_rl.errors import SpecError
from elastic_rl.event_kinds import EventKind
from elastic_rl.events import emit_event
from elastic_rl.fencing import Assignment
from elastic_rl.model.export import write_initial_checkpoint
from elastic_rl.model.gpt import ModelOptions, init_model_parallel
from elastic_rl.model.source import ModelSource
from elastic_rl.net import LOOPBACK
from elastic_rl.trainer.critic import Critic
from elastic_rl.trainer.grpo import GrpoTrainer, RolloutContext
from elastic_rl.trainer.heal_transport import LoopbackTransport
from elastic_rl.trainer.lr_schedule import lr_lambda
from elastic_rl.trainer.nan_injection import install_from_environment
from elastic_rl.trainer.nan_response import respond_to_nan
from elastic_rl.trainer.offload import Residency
from elastic_rl.trainer.optimizer import (
    build_optimizer,
    load_trained_state,
    local_optimizer,
    main_weights,
    scheduled,
    trained_state,
)
from elastic_rl.trainer.publisher import RolloutPublisher
from elastic_rl.trainer.straggler_response import respond_to_straggling
from elastic_rl.trainer.warm_spare import wait_for_place
from elastic_rl.trainer.weight_broadcast import WeightBroadcaster
from policies.devices import CrossReplicaGroup, Precision, cross_replica_group, offload_problem, precision_problem
from policies.exits import EXIT_DRAINED, EXIT_STRAGGLED
from policies.straggler import StragglerAction, StragglerVerdict, due

log = logging.getLogger("elastic_rl.trainer")

POLL_INTERVAL_S = 0.05
TORCHFT_GROUPS = {
    CrossReplicaGroup.GLOO: ProcessGroupGloo,
    CrossReplicaGroup.NCCL: ProcessGroupNCCL,
    CrossReplicaGroup.BABY_NCCL: ProcessGroupBabyNCCL,
}


class StopRequest:
    """Set by SIGTERM (`erl stop`): finish the rollout in hand, snapshot, exit."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum, frame) -> None:
        self.requested = True


class TrainerReplica:
    """This process's rank of its replica: the model, its optimizer, and where it stands in the run."""

    def __init__(self, env: jobenv.JobEnv, stop: StopRequest, imports_done: float):
        self.spec, self.workdir, self.job = env.spec, env.workdir, env.job
        self.stop_request = stop
        self.imports_done = imports_done  # wall-clock time: a resume's first cost ends here
        spec = self.spec
        self.device = os.environ.get(jobenv.DEVICE)  # the slot, as events name it
        self.compute = process_device.assigned()
        precision = spec.trainer.dtype
        problems = [precision_problem(self.compute, precision)]
        if spec.trainer.optimizer_offload:
            problems.append(offload_problem(self.compute))
        if any(problems):
            raise SpecError([problem for problem in problems if problem])
        process_device.use_deterministic_algorithms(self.compute)
        torch.set_num_threads(spec.trainer.cpu_threads)

        init_model_parallel(
            spec.trainer.tensor_parallel,
            spec.seed,
            timeout_s=spec.fault_tolerance.model_parallel_timeout_s,
            device=self.compute,
            pipeline_parallel=spec.trainer.pipeline_parallel,
            expert_parallel=spec.trainer.expert_parallel,
            context_parallel=spec.trainer.context_parallel,
        )
        self.rank = torch.distributed.get_rank()
        self.source = ModelSource.from_spec(spec.model)
        where = self.compute.torch_device
        options = ModelOptions.of(spec.trainer)
        self.model = self.source.build_policy(options, where)
        self.reference = None
        if spec.algorithm.kl_coef > 0:
            # Taken before any snapshot or heal: a restarted replica builds the same reference.
            self.reference = self.source.build_reference(self.model, spec.algorithm.reference, options, where)
        self.teacher = None
        if spec.algorithm.distillation is not None and spec.algorithm.distillation.engines is None:
            # Frozen like the reference, and likewise never snapshotted: every replica loads the same teacher.
            teacher = str(spec.algorithm.distillation.teacher)
            self.teacher = self.source.build_reference(self.model, teacher, options, where)
        for frozen in (self.reference, self.teacher):
            if frozen is not None and precision is Precision.BF16_PARAMS:
                frozen.bfloat16()  # as the policy computes once its optimizer casts it
        self.steps_per_rollout = spec.rollout.samples_per_rollout // spec.trainer.global_batch_size
        self.total_steps = spec.rollout.num_rollouts * self.steps_per_rollout
        self.critic = None
        if spec.algorithm.critic is not None:
            # Built from the fresh policy, like the reference; unlike it, trained, snapshotted and healed.
            model = self.source.build_critic(self.model, spec.algorithm.critic.hf_checkpoint, options, where)
            self.critic = Critic(spec, model, self.total_steps)
        self.optimizer = build_optimizer(self.model, spec.trainer)
        # This rank's part of the optimizer's state (all of it, unless sharded): what snapshots, heals and
        # offloads take.
        self.local_optimizer = local_optimizer(self.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            scheduled(self.optimizer), lr_lambda(spec.trainer, self.total_steps)
        )
        self.state = TrainingState(
            self.model,
            self.local_optimizer,
            self.scheduler,
            main_weights(self.optimizer),
            optimizer_on_host=spec.trainer.optimizer_offload,
            critic=None if self.critic is None else self.critic.training_state(on_host=spec.trainer.optimizer_offload),
        )
        self.spec_hash = jobenv.spec_hash(spec)
        # Colocated: the state leaves the device for the engines' turn (``trainer.offload``).
        self.residency = None
        if spec.colocated:
            critic = self.critic
            optimizers = [self.local_optimizer] + ([critic.local_optimizer] if critic is not None else [])
            self.residency = Residency(
                (self.model, self.reference, self.teacher, None if critic is None else critic.model),
                [] if spec.trainer.optimizer_offload else optimizers,
                torch.device(where),
                spec.fault_tolerance.handover_timeout_s,
                gradients=lambda device: self.trainer.move_gradients(device),
            )
        self.handover_times: dict[str, float] = {}

        self.assignment = Assignment.from_environ()
        self.spare = os.environ.get(jobenv.SPARE)
        self.replica = int(os.environ.get(jobenv.REPLICA, "0"))

        # Where this rank stands; set as the run goes.
        self.context: RolloutContext | None = None
        self.healed: dict[str, Any] = {}
        self.snapshot: SnapshotInfo | None = None  # to load at the first quorum, unless a peer heals us
        self.first_rollout = 0
        self.leader = False
        self.participants = 0
        self.trained_any = False
        self.leaving = False  # asked to leave a draining node: after the rollout in hand
        self.straggling: StragglerVerdict | None = None  # the last committed step's straggler verdict
        self.rollout_wait_s = 0.0  # how long the rollout in hand took to be committed after it was wanted
        self.lighthouse = os.environ[jobenv.LIGHTHOUSE_URL]
        # A resume's costs (report_caught_up): set as the replica joins and loads its snapshot.
        self.setup_s = 0.0
        self.load_s = 0.0
        self.replay_end = -1
        self.replay_started = time.monotonic()

    @property
    def proc(self) -> str:
        return f"trainer-{self.replica}-{self.rank}"

    @property
    def writer(self) -> dict[str, Any]:
        """Which process instance writes a snapshot: the chaos checker proves one writer per replica with it."""
        return {"proc": self.proc, "generation": self.assignment.generation}

    # --- joining ---------------------------------------------------------------

    def write_initial_weights(self) -> None:
        """A new job's weights version 0, which its engines start from: replica 0 writes the model it
        has just built (each of its ranks takes part in gathering it, rank 0 writes), so no other
        process builds the model again for them. Nothing is written once any version exists: a
        resumed job's engines serve that one."""
        if self.replica != 0 or self.spare is not None:
            return
        missing = [layout.latest_weights_version(self.workdir) is None]
        torch.distributed.broadcast_object_list(missing, src=0)  # every rank takes the same branch
        if missing[0]:
            write_initial_checkpoint(self.source, self.model, layout.weights_dir(self.workdir, 0))

    def take_place(self) -> bool:
        """A warm spare waits, imports done and model built, until erld gives it a replica's place.

        False if a stop came first. A replica started as itself has its place already.
        """
        if self.spare is None:
            return True
        spare = f"spare-{self.spare}-{self.assignment.generation}"
        place = wait_for_place(self.workdir, spare, lambda: self.stop_request.requested)
        if place is None:
            return False
        self.replica = place.replica
        self.assignment.take_over(self.proc, place.generation)
        return True

    def _make_manager(self) -> Manager:
        """A torchft Manager for this rank, asking ``self.lighthouse`` for its quorums."""
        ft = self.spec.fault_tolerance
        collective_timeout = timedelta(seconds=ft.collective_timeout_s)
        host = os.environ.get(jobenv.ADVERTISE_HOST, LOOPBACK)  # what peers reach this replica at
        group = cross_replica_group(self.compute, CrossReplicaGroup(ft.gpu_process_group))
        return Manager(
            pg=TORCHFT_GROUPS[group](timeout=collective_timeout),
            min_replica_size=1,
            load_state_dict=self.heal,
            state_dict=self.heal_state,
            replica_id=f"{self.job}-replica{self.replica}",
            lighthouse_addr=self.lighthouse,
            hostname=host,
            rank=self.rank,
            world_size=self.spec.trainer.ranks_per_replica,
            use_async_quorum=False,
            # Every replica starts from the same seeded weights or the same snapshot.
            init_sync=False,
            checkpoint_transport=LoopbackTransport(collective_timeout, host),
            timeout=collective_timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=collective_timeout,
        )

    def join(self) -> None:
        """Connect to the quorum, then find where to resume."""
        spec, ft = self.spec, self.spec.fault_tolerance
        host = os.environ.get(jobenv.ADVERTISE_HOST, LOOPBACK)
        self.manager = self._make_manager()
        self.setup_s = time.time() - self.imports_done  # model, optimizer, process groups, manager
        self.snapshots = SnapshotWriter(
            self.workdir,
            spec.checkpoints.async_save,
            on_committed=self._retain,
            on_failed=self._save_failed,
            timeout=timedelta(seconds=ft.model_parallel_timeout_s),
        )
        self.trainer = GrpoTrainer(
            spec,
            self.model,
            self.optimizer,
            self.scheduler,
            self.manager,
            self.replica,
            self.reference,
            self.snapshots.wait_staged,
            teacher=self.teacher,
            critic=self.critic,
        )
        install_from_environment(self.trainer, self.replica)  # the chaos harness's NaN fault, if it set one
        broadcaster = None
        if spec.engines.weight_sync == "distributed" and self.rank == 0:
            broadcaster = WeightBroadcaster(
                spec, os.environ[jobenv.ROUTER_URL], host, torch.device(self.compute.torch_device)
            )
        self.publisher = RolloutPublisher(spec, self.workdir, self.model, self.source, broadcaster, self.proc)
        self.leader = self.replica == 0  # until a quorum names participant 0
        self.resume()
        if self.rank == 0:
            imports = self.imports_done - psutil.Process().create_time()
            emit_event(
                EventKind.TRAINER_READY,
                f"imports {imports:.2f}s, setup {self.setup_s:.2f}s; asks for a quorum next",
                self.proc,
                device=self.device,
                imports_s=imports,
                setup_s=self.setup_s,
            )

    def resume(self) -> None:
        """Take the newest snapshot's position. Its tensors are loaded at the first quorum, unless
        that quorum heals this replica from a peer that is further on."""

        def skipped(path: Path, why: str) -> None:
            log.warning("skipping snapshot %s: %s", path, why)
            emit_event(EventKind.SNAPSHOT_SKIPPED, f"{path.name}: {why}; resuming from an older one", self.proc)

        self.snapshot = newest_valid_snapshot(self.workdir, on_invalid=skipped)
        self.first_rollout = self.snapshot.last_rollout + 1 if self.snapshot is not None else 0
        self.manager.load_state_dict({"step": self.first_rollout * self.steps_per_rollout, "batches_committed": 0})
        # The rollouts already committed now are a replay.
        self.replay_end = max(layout.committed_rollouts(self.workdir), default=-1)
        self.replay_started = time.monotonic()
        self.load_s = 0.0

    # --- the quorum's callbacks: what a healing peer takes, and taking it --------

    def heal_state(self) -> dict[str, Any]:
        return {
            **trained_state(self.model, self.optimizer, self.scheduler),
            "rollout": self.context.heal_state() if self.context is not None else None,
            "critic": None if self.critic is None else self.critic.heal_state(),
        }

    def heal(self, state: dict[str, Any]) -> None:
        load_trained_state(self.model, self.optimizer, self.scheduler, state)
        if self.critic is not None:
            self.critic.heal(state["critic"])
        self.healed.update(rollout=state["rollout"])

    # --- the loop --------------------------------------------------------------

    def run(self) -> None:
        meet_peers_at = self.rollout_peers_train_next()
        while (position := self.manager.current_step()) < self.total_steps:
            rollout_id, index = divmod(position, self.steps_per_rollout)
            if index == 0 and rollout_id in layout.quarantined_rollouts(self.workdir):
                self.skip_quarantined(rollout_id, position)
                continue
            if index == 0 and self.residency is not None:
                self.residency.offload()  # the engines' turn (a no-op after a published rollout)
            waited_for = max(rollout_id, meet_peers_at)
            meet_peers_at = -1
            if index == 0 and (self.stop_request.requested or not self.wait_for_rollout(waited_for)):
                self.stop(rollout_id)
                break
            if index == 0:
                self.follow_lighthouse(rollout_id)
                if self.residency is not None:
                    self.handover_times["train/onload_time"] = self.residency.onload()
            position, peer_rollout = self.start_quorum(position)
            rollout_id, index = divmod(position, self.steps_per_rollout)
            if not self.train_step(rollout_id, index, position, peer_rollout):
                continue
            if index == self.steps_per_rollout - 1:
                self.publish(rollout_id)
                if self.leaving:
                    self.leave(rollout_id)
            self.act_on_straggling(position)
        self.snapshots.wait()
        self.manager.shutdown(wait=False)

    def rollout_peers_train_next(self) -> int:
        """The rollout after the newest published weights: what running peers train next.

        A replica that starts (resumed from a snapshot, or from the initial weights) behind them waits
        for that rollout before its first quorum, so that the quorum meets them and heals it from them.
        Asking at once, while they wait for that rollout, would give it a quorum of its own, in which it
        trains again what they have trained. With no peer left it replays that rollout itself, once it
        is committed (its weights are published, so the orchestrator generates it)."""
        published = layout.latest_weights_version(self.workdir) or 0
        return min(published, self.spec.rollout.num_rollouts - 1)

    def follow_lighthouse(self, rollout_id: int) -> None:
        """Make the Manager again if the orchestrator that committed this rollout (after this process
        started: a replayed rollout's lighthouse may be gone) names another lighthouse than ours."""
        named = read_meta(layout.rollout_dir(self.workdir, rollout_id)).get("lighthouse")
        if named is None or named == self.lighthouse or rollout_id <= self.replay_end:
            return
        step, committed = self.manager.current_step(), self.manager.batches_committed()
        self.manager.shutdown(wait=False)
        self.lighthouse = named
        # Rank 0 publishes its new manager server's address in the replica's store, over the old
        # one's: the other ranks read it only after that.
        torch.distributed.barrier()
        if self.rank == 0:
            self.manager = self._make_manager()
        torch.distributed.barrier()
        if self.rank != 0:
            self.manager = self._make_manager()
        self.manager.load_state_dict({"step": step, "batches_committed": committed})
        self.trainer.manager = self.manager
        if self.rank == 0:
            emit_event(
                EventKind.LIGHTHOUSE_FOLLOWED,
                f"asks {named} for its quorums from rollout {rollout_id}; state kept in memory",
                self.proc,
                device=self.device,
                rollout=rollout_id,
            )

    def leave(self, rollout_id: int) -> None:
        """Its node drains: leave the quorum after this rollout, with nothing left unsaved."""
        self.snapshots.wait()
        self.manager.shutdown(wait=False)
        if self.rank == 0:
            emit_event(
                EventKind.REPLICA_LEFT,
                f"left the quorum after rollout {rollout_id}: its node drains",
                self.proc,
                device=self.device,
                rollout=rollout_id,
            )
        sys.exit(EXIT_DRAINED)

    def wait_for_rollout(self, rollout_id: int) -> bool:
        """Wait until rollout ``rollout_id`` is committed; False if a stop came first."""
        folder = layout.rollout_dir(self.workdir, rollout_id)
        started = time.monotonic()
        while not folder.is_dir():
            if self.stop_request.requested:
                return False
            self.publisher.take_over_if_missing()
            time.sleep(POLL_INTERVAL_S)
        self.rollout_wait_s = time.monotonic() - started
        return True

    def skip_quarantined(self, rollout_id: int, position: int) -> None:
        """A rollout set aside by the NaN guard: no training; the weights carry over to the next version."""
        for _ in range(self.steps_per_rollout):
            self.scheduler.step()
        self.manager.load_state_dict({"step": position + self.steps_per_rollout, "batches_committed": 0})
        self.assignment.exit_if_superseded_blocking()
        self.publisher.publish(rollout_id, {"train/quarantined": 1.0}, exporter=self.leader)

    def start_quorum(self, position: int) -> tuple[int, dict[str, Any] | None]:
        """Join the step's quorum: heal from a peer if behind, else load the resume snapshot if one waits.

        Returns the position to train (a heal moves it to the peer's) and the peer's rollout
        state when the heal landed mid-rollout.
        """
        self.healed.clear()
        self.manager.start_quorum()
        if self.healed:
            # Behind the quorum: this replica took a peer's state, and with it the peer's position.
            self.snapshot, self.context = None, None
            position = self.manager.current_step()
            rollout_id = position // self.steps_per_rollout
            log.info("healed from a peer at step %d (rollout %d)", position, rollout_id)
            emit_event(
                EventKind.REPLICA_HEALED,
                f"took a peer's state at step {position}",
                self.proc,
                device=self.device,
                step=position,
            )
            # A peer at a rollout's first step may still hold the previous rollout's context:
            # the healed weights are the ones to compute it from.
            peer = self.healed["rollout"]
            return position, peer if peer and peer["rollout_id"] == rollout_id else None
        if self.snapshot is not None:
            load_started = time.monotonic()
            step, last_rollout = load_snapshot(self.state, self.snapshot.path, self.snapshots.group)
            self.load_s = time.monotonic() - load_started
            self.snapshot = None
            log.info("resumed from snapshot: step %d, last rollout %d", step, last_rollout)
            # Rollouts whose training some replica had already published: this replay trains them again.
            published = layout.latest_weights_version(self.workdir) or 0
            redone = max(0, published - layout.version_after(last_rollout))
            emit_event(
                EventKind.TRAINER_RESUMED,
                f"from snapshot {step}, replaying after rollout {last_rollout} ({redone} rollout(s) trained again)",
                self.proc,
                device=self.device,
                step=step,
                redone_rollouts=redone,
            )
        return position, None

    def train_step(self, rollout_id: int, index: int, position: int, peer_rollout: dict[str, Any] | None) -> bool:
        """Train step ``index`` of the rollout; whether the quorum committed it."""
        if self.context is None or self.context.rollout_id != rollout_id:
            batch = read_rollout(self.workdir, rollout_id)[0]
            self.context = self.trainer.prepare(rollout_id, batch, peer_rollout)
        if self.manager.num_participants() != self.participants:
            self.participants = self.manager.num_participants()
            if self.manager.participating_rank() == 0 and self.rank == 0:
                emit_event(
                    EventKind.QUORUM_CHANGED,
                    f"{self.participants} replica(s) train from step {position}",
                    self.proc,
                    device=self.device,
                    step=position,
                    participants=self.participants,
                )
        outcome = self.trainer.step(self.context, index)
        respond_to_nan(
            outcome.decision,
            reports=outcome.leader and self.rank == 0,
            workdir=self.workdir,
            rollout_id=rollout_id,
            step=position,
            proc=self.proc,
            replica=self.replica,
            device=self.device,
        )
        if outcome.committed:
            self.trained_any = True
            self.leader = outcome.leader
        self.straggling = outcome.straggling
        return outcome.committed

    def act_on_straggling(self, position: int) -> None:
        """After a committed step (and its rollout's publishing): a replica the straggler rule names, at a
        step where it is due to act, leaves for a replacement or says it cannot (``trainer.straggler_response``)."""
        verdict, self.straggling = self.straggling, None
        rule = self.spec.fault_tolerance.straggler_rule
        if verdict is None or rule is None:
            return
        streak = verdict.streaks.get(self.replica, 0)
        if not due(streak, rule):
            return
        action = respond_to_straggling(
            self.spec,
            ratio=verdict.ratios[self.replica],
            streak=streak,
            participants=self.participants,
            proc=self.proc,
            device=self.device,
            step=position,
        )
        if action is StragglerAction.LEAVE:
            self.snapshots.wait()
            self.manager.shutdown(wait=False)
            sys.exit(EXIT_STRAGGLED)

    def publish(self, rollout_id: int) -> None:
        """After a rollout's last step: snapshot when due, then the weights and metrics for the engines."""
        metrics = self.trainer.rollout_metrics(self.context)
        # The orchestrator's time, as the trainers saw it (in sync mode: the weights' load and the generation).
        metrics["train/wait_rollout_time"] = self.rollout_wait_s
        # Nothing is committed by a replica whose assignment a newer instance holds.
        self.leaving = self.assignment.exit_if_superseded_blocking()
        # Replica leader snapshots for the job; the others hold the same state.
        if self.leader and (rollout_id + 1) % self.spec.checkpoints.interval_rollouts == 0:
            metrics.update(self.save_snapshot(rollout_id))
        weights = self.publisher.gather()  # on the device: the gather's collectives run there
        if self.residency is not None:
            # Offloaded before the weights go out: the engines take their turn as soon as they have them.
            self.handover_times["train/offload_time"] = self.residency.offload()
            self.residency.write_peaks(self.workdir, rollout_id, self.proc, os.environ.get(jobenv.NODE), self.device)
            metrics.update(self.handover_times)
        self.publisher.publish(rollout_id, metrics, self.leader, weights)
        if rollout_id == self.replay_end and self.first_rollout > 0:
            self.report_caught_up(rollout_id)

    def save_snapshot(self, rollout_id: int) -> dict[str, float]:
        """Start the snapshot of the state after ``rollout_id``; what it cost the loop."""
        stall_started = time.monotonic()
        self.snapshots.save(self.state, self.scheduler.last_epoch, rollout_id, self.spec_hash, self.writer)
        return {
            "train/snapshot_call_time": time.monotonic() - stall_started,
            "train/snapshot_wait_previous_time": self.snapshots.last_wait_s,
        }

    def report_caught_up(self, rollout_id: int) -> None:
        """A resumed replica has replayed what was committed before it started: the resume's cost, in parts."""
        if self.rank != 0:
            return
        costs = {
            "imports_s": self.imports_done - psutil.Process().create_time(),
            "setup_s": self.setup_s,
            "load_s": self.load_s,
            "replay_s": time.monotonic() - self.replay_started,
        }
        emit_event(
            EventKind.TRAINER_CAUGHT_UP,
            f"replayed rollouts {self.first_rollout}..{rollout_id}",
            self.proc,
            device=self.device,
            rollouts=rollout_id - self.first_rollout + 1,
            **costs,
        )

    def stop(self, rollout_id: int) -> None:
        """`erl stop`: the final snapshot, of the state after the last rollout applied."""
        if self.leader and self.trained_any:
            self.assignment.exit_if_superseded_blocking()
            self.snapshots.save(self.state, self.scheduler.last_epoch, rollout_id - 1, self.spec_hash, self.writer)

    # --- snapshots' outcomes ------------------------------------------------------

    def _retain(self, step: int, path: Path) -> None:
        log.info("snapshot %d committed: %s", step, path)
        apply_retention(self.workdir, self.spec.checkpoints.keep_last, self.spec.checkpoints.keep_every)

    def _save_failed(self, step: int, error: BaseException) -> None:
        log.error("snapshot %d failed: %r", step, error)
        emit_event(
            EventKind.SNAPSHOT_FAILED,
            f"snapshot {step} not saved ({error}); the next one tries again",
            self.proc,
            step=step,
        )
