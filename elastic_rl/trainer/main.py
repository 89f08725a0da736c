"""The trainer process: one tensor-parallel rank of one replica.

    started by erld as: python -m elastic_rl.trainer.main
    (ERL_* variables from jobenv; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for the replica's TP group)

It builds the Megatron model and joins the job's torchft quorum through a
Manager (even with one replica). Its position in the run is the Manager's
step: rollout = step // steps_per_rollout. For each step it waits for the
orchestrator to commit that rollout, starts a quorum (a replica that is
behind heals from a peer here, taking its weights, optimizer, schedule and
the rollout in hand), and trains the step. After a rollout's last step the
step's participant 0 exports ``weights/<rollout + 1>`` for the engines with the
metrics beside them, and every ``checkpoints.interval_rollouts`` a snapshot.

Resume needs no flag: on start it restores the newest valid snapshot (an
invalid one is skipped with a log line) and replays the committed rollouts
after it, which are still in the log; with no snapshot it replays from the
initial weights, which the seed determines. A replica that joins running
peers skips the replay: the quorum heals it.

The NaN/Inf guard's responses that outlive a step end the process with an
exit code erld acts on: ``EXIT_ROLLBACK`` (the rollout batch is quarantined
and every replica restarts from the newest snapshot) and
``EXIT_DEVICE_QUARANTINED`` (this replica's device is set aside).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import orjson
import psutil
import torch
from torchft import Manager, ProcessGroupGloo

from checkpoints.discovery import SnapshotInfo, newest_valid_snapshot
from checkpoints.retention import apply_retention, prune_weights
from checkpoints.snapshot import SnapshotWriter, TrainingState, load_snapshot
from elastic_rl import jobenv
from elastic_rl.atomic import write_file_atomic
from elastic_rl.events import emit_event
from elastic_rl.fencing import Assignment
from elastic_rl.model.gpt import init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.source import ModelSource
from elastic_rl.net import LOOPBACK
from elastic_rl.rollout.batch import read_rollout
from elastic_rl.trainer.grpo import GrpoTrainer, RolloutContext, lr_lambda
from elastic_rl.trainer.heal_transport import LoopbackTransport
from elastic_rl.trainer.nan_injection import install_from_environment
from policies.exits import EXIT_DEVICE_QUARANTINED, EXIT_ROLLBACK
from policies.nan_guard import Response

log = logging.getLogger("elastic_rl.trainer")

# Wall-clock time once the imports above are done: a resume's first cost.
IMPORTS_DONE = time.time()

POLL_INTERVAL_S = 0.05
SPARE_POLL_INTERVAL_S = 0.01


class StopRequest:
    """Set by SIGTERM (`erl stop`): finish the rollout in hand, snapshot, exit."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum, frame) -> None:
        self.requested = True


def wait_for_rollout(workdir: Path, rollout_id: int, stop: StopRequest, publisher: RolloutPublisher) -> bool:
    """Wait until rollout ``rollout_id`` is committed; False if a stop came first."""
    folder = jobenv.rollout_dir(workdir, rollout_id)
    while not folder.is_dir():
        if stop.requested:
            return False
        publisher.take_over_if_missing()
        time.sleep(POLL_INTERVAL_S)
    return True


def wait_for_assignment(workdir: Path, spare: str, stop: StopRequest) -> tuple[int, int] | None:
    """Wait as warm spare ``spare`` (spare-<s>-<generation>) until erld gives it a replica's place;
    the replica and the generation of its assignment, or None if a stop came first."""
    path = jobenv.spare_assignment_path(workdir, spare)
    log.info("warm spare %s ready", spare)
    while not path.is_file():
        if stop.requested:
            return None
        time.sleep(SPARE_POLL_INTERVAL_S)
    given = orjson.loads(path.read_bytes())
    return int(given["replica"]), int(given["generation"])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    env = jobenv.JobEnv.from_environ()
    spec, workdir = env.spec, env.workdir
    tp = spec.trainer.tensor_parallel
    device = os.environ.get(jobenv.DEVICE)
    stop = StopRequest()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(spec.trainer.cpu_threads)

    init_model_parallel(tp, spec.seed)
    rank = torch.distributed.get_rank()
    source = ModelSource.from_spec(spec.model)
    model = source.build_policy()
    reference = None
    if spec.algorithm.kl_coef > 0:
        # Taken before any snapshot or heal: a restarted replica builds the same reference.
        reference = source.build_reference(model, spec.algorithm.reference)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=spec.trainer.lr,
        betas=(spec.trainer.adam_beta1, spec.trainer.adam_beta2),
        weight_decay=spec.trainer.weight_decay,
    )
    steps_per_rollout = spec.rollout.samples_per_rollout // spec.trainer.global_batch_size
    total_steps = spec.rollout.num_rollouts * steps_per_rollout
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec, total_steps))

    assignment = Assignment.from_environ()
    spare = os.environ.get(jobenv.SPARE)
    if spare is None:
        replica = int(os.environ.get(jobenv.REPLICA, "0"))
    else:
        # A warm spare: imports done, model built; it becomes a replica when erld says which.
        given = wait_for_assignment(workdir, f"spare-{spare}-{assignment.generation}", stop)
        if given is None:
            return
        replica, generation = given
        promoted = time.monotonic()
        assignment.take_over(f"trainer-{replica}-{rank}", generation)
    proc = f"trainer-{replica}-{rank}"

    context: RolloutContext | None = None
    healed: dict = {}

    def heal_state() -> dict:
        return {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rollout": context.heal_state() if context is not None else None,
        }

    def heal(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        healed.update(rollout=state["rollout"])

    ft = spec.fault_tolerance
    collective_timeout = timedelta(seconds=ft.collective_timeout_s)
    host = os.environ.get(jobenv.ADVERTISE_HOST, LOOPBACK)  # what peers reach this replica at
    manager = Manager(
        pg=ProcessGroupGloo(timeout=collective_timeout),
        min_replica_size=1,
        load_state_dict=heal,
        state_dict=heal_state,
        replica_id=f"{env.job}-replica{replica}",
        lighthouse_addr=os.environ[jobenv.LIGHTHOUSE_URL],
        hostname=host,
        rank=rank,
        world_size=tp,
        use_async_quorum=False,
        # Every replica starts from the same seeded weights or the same snapshot.
        init_sync=False,
        checkpoint_transport=LoopbackTransport(collective_timeout, host),
        timeout=collective_timeout,
        quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
        connect_timeout=collective_timeout,
    )
    state = TrainingState(model, optimizer, scheduler)
    setup_time = time.time() - IMPORTS_DONE  # model, optimizer, process groups, manager
    # Resume at the newest snapshot's position. Its tensors are loaded only if the first
    # quorum does not heal this replica from a peer that is further on.
    snapshot = find_snapshot(workdir, proc)
    first_rollout = snapshot.last_rollout + 1 if snapshot is not None else 0
    manager.load_state_dict({"step": first_rollout * steps_per_rollout, "batches_committed": 0})
    load_time = 0.0
    if rank == 0:
        imports = IMPORTS_DONE - psutil.Process().create_time()
        emit_event("trainer_ready", f"imports {imports:.2f}s, setup {setup_time:.2f}s; asks for a quorum next", proc,
                   device=device, imports_s=imports, setup_s=setup_time)  # fmt: skip

    def retain(step: int, path: Path) -> None:
        log.info("snapshot %d committed: %s", step, path)
        apply_retention(workdir, spec.checkpoints.keep_last, spec.checkpoints.keep_every)

    def save_failed(step: int, error: BaseException) -> None:
        log.error("snapshot %d failed: %r", step, error)
        emit_event("snapshot_failed", f"snapshot {step} not saved ({error}); the next one tries again", proc, step=step)

    snapshots = SnapshotWriter(workdir, spec.checkpoints.async_save, on_committed=retain, on_failed=save_failed)
    trainer = GrpoTrainer(spec, model, optimizer, scheduler, manager, replica, reference, snapshots.wait_staged)
    install_from_environment(trainer, replica)  # the chaos harness's NaN fault, if it set one
    publisher = RolloutPublisher(spec, workdir, model, source)
    spec_hash = jobenv.spec_hash(spec)
    # The rollouts already committed when the trainer starts are a replay (a resume).
    replay_end = max(jobenv.committed_rollouts(workdir), default=-1)
    replay_started = time.monotonic()
    leader = replica == 0  # until a quorum names participant 0
    participants = 0
    trained_any = False
    while (position := manager.current_step()) < total_steps:
        rollout_id, index = divmod(position, steps_per_rollout)
        if index == 0 and rollout_id in jobenv.quarantined_rollouts(workdir):
            # Set aside by the NaN guard: no training; the weights carry over to the next version.
            for _ in range(steps_per_rollout):
                scheduler.step()
            manager.load_state_dict({"step": position + steps_per_rollout, "batches_committed": 0})
            assignment.exit_if_superseded_blocking()
            publisher.publish(rollout_id, {"train/quarantined": 1.0}, exporter=leader)
            continue
        if index == 0 and (stop.requested or not wait_for_rollout(workdir, rollout_id, stop, publisher)):
            if leader and trained_any:
                # The final snapshot of `erl stop`: the state after the last rollout applied.
                assignment.exit_if_superseded_blocking()
                snapshots.save(state, scheduler.last_epoch, rollout_id - 1, spec_hash)
            break
        healed.clear()
        peer_rollout = None
        manager.start_quorum()
        if healed:
            # Behind the quorum: this replica took a peer's state, and with it the peer's position.
            snapshot, context = None, None
            position = manager.current_step()
            rollout_id, index = divmod(position, steps_per_rollout)
            # A peer at a rollout's first step may still hold the previous rollout's context:
            # the healed weights are the ones to compute it from.
            if healed["rollout"] and healed["rollout"]["rollout_id"] == rollout_id:
                peer_rollout = healed["rollout"]
            log.info("healed from a peer at step %d (rollout %d)", position, rollout_id)
            if spare is not None and not trained_any:
                log.info("warm spare %s joined as replica %d %.3fs after its assignment", spare, replica,
                         time.monotonic() - promoted)  # fmt: skip
            emit_event("replica_healed", f"took a peer's state at step {position}", proc, device=device, step=position)
        elif snapshot is not None:
            load_started = time.monotonic()
            step, last_rollout = load_snapshot(state, snapshot.path)
            load_time = time.monotonic() - load_started
            snapshot = None
            log.info("resumed from snapshot: step %d, last rollout %d", step, last_rollout)
            emit_event("trainer_resumed", f"from snapshot {step}, replaying after rollout {last_rollout}", proc,
                       device=device, step=step)  # fmt: skip
        if context is None or context.rollout_id != rollout_id:
            context = trainer.prepare(rollout_id, read_rollout(workdir, rollout_id)[0], peer_rollout)
        if manager.num_participants() != participants:
            participants = manager.num_participants()
            if manager.participating_rank() == 0 and rank == 0:
                emit_event("quorum_changed", f"{participants} replica(s) train from step {position}", proc,
                           device=device, step=position, participants=participants)  # fmt: skip
        outcome = trainer.step(context, index)
        respond_to_nan(outcome, workdir, proc, device, position, rollout_id, replica, rank)
        if not outcome.committed:
            continue
        trained_any = True
        leader = outcome.leader
        if index < steps_per_rollout - 1:
            continue
        metrics = trainer.rollout_metrics(context)
        version = rollout_id + 1
        # Nothing is committed by a replica whose assignment a newer instance holds.
        assignment.exit_if_superseded_blocking()
        # Replica leader snapshots for the job; the others hold the same state.
        if leader and version % spec.checkpoints.interval_rollouts == 0:
            stall_started = time.monotonic()
            snapshots.save(state, scheduler.last_epoch, rollout_id, spec_hash)
            metrics["train/snapshot_call_time"] = time.monotonic() - stall_started
            metrics["train/snapshot_wait_previous_time"] = snapshots.last_wait_s
        publisher.publish(rollout_id, metrics, exporter=leader)
        if rollout_id == replay_end and first_rollout > 0:
            log.info(
                "resume timing: imports %.2fs, setup %.2fs, snapshot load %.2fs, replay %.2fs (%d rollouts)",
                IMPORTS_DONE - psutil.Process().create_time(), setup_time, load_time,
                time.monotonic() - replay_started, replay_end - first_rollout + 1,
            )  # fmt: skip
    snapshots.wait()
    manager.shutdown(wait=False)


def respond_to_nan(outcome, workdir: Path, proc: str, device: str | None, step: int, rollout_id: int, replica: int, rank: int) -> None:
    """Record the NaN guard's decision; end the process where the response needs a restart."""
    decision = outcome.decision
    where = {"device": device, "step": step, "rollout": rollout_id}
    if decision.response is Response.SKIP and outcome.leader and rank == 0:
        emit_event("nan_step_skipped", f"{decision.reason}; step {step} redone", proc, **where)
    elif decision.response is Response.ROLLBACK:
        write_file_atomic(
            jobenv.quarantine_path(workdir, rollout_id),
            orjson.dumps({"rollout_id": rollout_id, "step": step, "reason": decision.reason}),
        )
        if outcome.leader and rank == 0:
            emit_event("rollout_quarantined", f"{decision.reason}; rolling back to the newest snapshot", proc, **where)
        sys.exit(EXIT_ROLLBACK)
    elif decision.response is Response.QUARANTINE_DEVICE and replica in decision.replicas:
        emit_event("device_quarantined", decision.reason, proc, **where)
        sys.exit(EXIT_DEVICE_QUARANTINED)


class RolloutPublisher:
    """Hands a trained rollout to the engines: HF weights for version rollout + 1, and the metrics.

    The step's participant 0 publishes. Every replica gathers the weights, as
    they all hold the same ones, so that if the publisher died between its
    commit and its export, another replica's rank 0 writes the missing version
    while it waits for the next rollout (no collective is needed there).
    """

    def __init__(self, spec, workdir: Path, model, source: ModelSource):
        self.spec, self.workdir, self.model, self.source = spec, workdir, model, source
        self.rank0 = torch.distributed.get_rank() == 0
        self.pending: tuple[int, dict, dict] | None = None
        self.pending_since = 0.0
        self.takeover_after_s = 2 * spec.fault_tolerance.heartbeat_timeout_ms / 1000 + 1.0

    def publish(self, rollout_id: int, metrics: dict, exporter: bool) -> None:
        # Every TP rank takes part in gathering the weights; rank 0 writes.
        weights = full_state_dict(self.model)
        if not self.rank0:
            return
        if exporter:
            self._write(rollout_id, weights, metrics)
        else:
            self.pending, self.pending_since = (rollout_id, weights, metrics), time.monotonic()

    def take_over_if_missing(self) -> None:
        """Called while waiting for the next rollout: publish what the leader did not."""
        if self.pending is None or time.monotonic() - self.pending_since < self.takeover_after_s:
            return
        rollout_id, weights, metrics = self.pending
        self.pending = None
        if not jobenv.weights_dir(self.workdir, rollout_id + 1).exists():
            log.warning("weights %d were not published by the leader; publishing them", rollout_id + 1)
            self._write(rollout_id, weights, metrics)

    def _write(self, rollout_id: int, weights: dict, metrics: dict) -> None:
        version = rollout_id + 1
        target = jobenv.weights_dir(self.workdir, version)
        # A replayed rollout reproduces weights exported before: kept, or pruned as no longer needed.
        if not target.exists() and version > (jobenv.latest_weights_version(self.workdir) or 0):
            started = time.monotonic()
            try:
                self.source.export(target, weights)
            except OSError:
                if not target.exists():
                    raise  # not another replica's export of the same version: a real failure
            metrics = {**metrics, "train/export_time": time.monotonic() - started}
        write_file_atomic(jobenv.train_metrics_path(self.workdir, rollout_id), orjson.dumps(metrics))
        prune_weights(self.workdir, self.spec.checkpoints.keep_weights, self.spec.engines.startup_timeout_s)
        log.info("rollout %d trained: weights version %d %s", rollout_id, version, metrics)


def find_snapshot(workdir: Path, proc: str) -> SnapshotInfo | None:
    """The newest valid snapshot, reporting the invalid ones skipped on the way."""

    def skipped(path: Path, why: str) -> None:
        log.warning("skipping snapshot %s: %s", path, why)
        emit_event("snapshot_skipped", f"{path.name}: {why}; resuming from an older one", proc)

    return newest_valid_snapshot(workdir, on_invalid=skipped)


if __name__ == "__main__":
    main()
