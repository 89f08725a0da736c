"""The trainer process: one tensor-parallel rank of one replica.

    started by erld as: python -m elastic_rl.trainer.main
    (ERL_* variables from jobenv; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for the replica's TP group)

It builds the Megatron model, joins the job's torchft quorum through a Manager
(even with one replica), then for each rollout in order: waits for the
orchestrator to commit it, trains on it, and exports the new weights to
``weights/<rollout + 1>`` for the engines, with its metrics beside them. Every
``checkpoints.interval_rollouts`` it takes a snapshot.

Resume needs no flag: on start it restores the newest valid snapshot (an
invalid one is skipped with a log line) and replays the committed rollouts
after it, which are still in the log; with no snapshot it replays from the
initial weights, which the seed determines.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import orjson
import psutil
import torch
from torchft import Manager, ProcessGroupGloo

from checkpoints.discovery import newest_valid_snapshot
from checkpoints.retention import apply_retention
from checkpoints.snapshot import SnapshotWriter, TrainingState, load_snapshot
from elastic_rl import jobenv
from elastic_rl.atomic import write_file_atomic
from elastic_rl.events import emit_event
from elastic_rl.model.convert import export_hf
from elastic_rl.model.gpt import build_gpt, init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.tokenizer import load_tokenizer, padded_vocab_size
from elastic_rl.rollout.batch import read_rollout
from elastic_rl.trainer.grpo import GrpoTrainer, lr_lambda

log = logging.getLogger("elastic_rl.trainer")

# Wall-clock time once the imports above are done: a resume's first cost.
IMPORTS_DONE = time.time()

POLL_INTERVAL_S = 0.05


class StopRequest:
    """Set by SIGTERM (`erl stop`): finish the rollout in hand, snapshot, exit."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum, frame) -> None:
        self.requested = True


def wait_for_rollout(workdir: Path, rollout_id: int, stop: StopRequest) -> bool:
    """Wait until rollout ``rollout_id`` is committed; False if a stop came first."""
    folder = jobenv.rollout_dir(workdir, rollout_id)
    while not folder.is_dir():
        if stop.requested:
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    env = jobenv.JobEnv.from_environ()
    spec, workdir = env.spec, env.workdir
    tp = spec.trainer.tensor_parallel
    replica = int(os.environ.get(jobenv.REPLICA, "0"))
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    init_model_parallel(tp, spec.seed)
    rank = torch.distributed.get_rank()
    tokenizer = load_tokenizer(spec.model.tokenizer)
    vocab_size = padded_vocab_size(tokenizer)
    model = build_gpt(spec.model, vocab_size, tp)
    reference = None
    if spec.algorithm.kl_coef > 0:
        # The same seed builds the same initial weights: the frozen reference policy.
        reference = build_gpt(spec.model, vocab_size, tp).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=spec.trainer.lr,
        betas=(spec.trainer.adam_beta1, spec.trainer.adam_beta2),
        weight_decay=spec.trainer.weight_decay,
    )
    steps_per_rollout = spec.rollout.samples_per_rollout // spec.trainer.global_batch_size
    total_steps = spec.rollout.num_rollouts * steps_per_rollout
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec, total_steps))

    ft = spec.fault_tolerance
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=ft.quorum_timeout_s)),
        min_replica_size=1,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), optimizer.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"{env.job}-replica{replica}",
        lighthouse_addr=os.environ[jobenv.LIGHTHOUSE_URL],
        rank=rank,
        world_size=tp,
        use_async_quorum=False,
        timeout=timedelta(seconds=ft.quorum_timeout_s),
        quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
    )
    exporter = replica == 0 and rank == 0
    state = TrainingState(model, optimizer, scheduler)
    setup_time = time.time() - IMPORTS_DONE  # model, optimizer, process groups, quorum
    load_started = time.monotonic()
    proc = f"trainer-{replica}-{rank}"
    first_rollout = resume(state, workdir, proc)
    load_time = time.monotonic() - load_started

    def retain(step: int, path: Path) -> None:
        log.info("snapshot %d committed: %s", step, path)
        apply_retention(workdir, spec.checkpoints.keep_last, spec.checkpoints.keep_every)

    def save_failed(step: int, error: BaseException) -> None:
        log.error("snapshot %d failed: %r", step, error)
        emit_event("snapshot_failed", f"snapshot {step} not saved ({error}); the next one tries again", proc, step=step)

    snapshots = SnapshotWriter(workdir, spec.checkpoints.async_save, on_committed=retain, on_failed=save_failed)
    trainer = GrpoTrainer(spec, model, optimizer, scheduler, manager, reference, snapshots.wait_staged)
    spec_hash = jobenv.spec_hash(spec)
    stop = StopRequest()
    # The rollouts already committed when the trainer starts are a replay (a resume).
    replay_end = max(jobenv.committed_rollouts(workdir), default=-1)
    replay_started = time.monotonic()
    for rollout_id in range(first_rollout, spec.rollout.num_rollouts):
        if not wait_for_rollout(workdir, rollout_id, stop) or stop.requested:
            if replica == 0 and rollout_id > first_rollout:
                # The final snapshot of `erl stop`: the state after the last rollout applied.
                snapshots.save(state, scheduler.last_epoch, rollout_id - 1, spec_hash)
            break
        batch, _ = read_rollout(workdir, rollout_id)
        metrics = trainer.train_rollout(batch)
        weights = full_state_dict(model)
        version = rollout_id + 1
        # A replayed rollout reproduces the weights it exported before: keep those.
        if exporter and not jobenv.weights_dir(workdir, version).exists():
            export_hf(jobenv.weights_dir(workdir, version), weights, spec.model, vocab_size, tokenizer)
        # Replica 0 snapshots for the job; the others hold the same state.
        if replica == 0 and version % spec.checkpoints.interval_rollouts == 0:
            stall_started = time.monotonic()
            snapshots.save(state, scheduler.last_epoch, rollout_id, spec_hash)
            metrics["train/snapshot_call_time"] = time.monotonic() - stall_started
            metrics["train/snapshot_wait_previous_time"] = snapshots.last_wait_s
        if exporter:
            write_file_atomic(jobenv.train_metrics_path(workdir, rollout_id), orjson.dumps(metrics))
            log.info("rollout %d trained: weights version %d %s", rollout_id, version, metrics)
        if rollout_id == replay_end and first_rollout > 0:
            log.info(
                "resume timing: imports %.2fs, setup %.2fs, snapshot load %.2fs, replay %.2fs (%d rollouts)",
                IMPORTS_DONE - psutil.Process().create_time(), setup_time, load_time,
                time.monotonic() - replay_started, replay_end - first_rollout + 1,
            )  # fmt: skip
    snapshots.wait()
    manager.shutdown(wait=False)


def resume(state: TrainingState, workdir: Path, proc: str) -> int:
    """Restore the newest valid snapshot, if any; return the first rollout to train."""

    def skipped(path: Path, why: str) -> None:
        log.warning("skipping snapshot %s: %s", path, why)
        emit_event("snapshot_skipped", f"{path.name}: {why}; resuming from an older one", proc)

    info = newest_valid_snapshot(workdir, on_invalid=skipped)
    if info is None:
        return 0
    step, last_rollout = load_snapshot(state, info.path)
    log.info("resumed from snapshot %s: step %d, last rollout %d", info.path, step, last_rollout)
    emit_event("trainer_resumed", f"from snapshot {step}, replaying after rollout {last_rollout}", proc, step=step)
    return last_rollout + 1


if __name__ == "__main__":
    main()
