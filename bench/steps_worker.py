"""A training worker for bench/torchrun_compare.py: the same GRPO steps under torchrun or under torchft.

    torchrun ... bench/steps_worker.py torchrun WORKDIR STEPS SNAPSHOT_EVERY
    python bench/steps_worker.py torchft WORKDIR STEPS REPLICA LIGHTHOUSE_URL STORE_PORT
    python bench/steps_worker.py torchft WORKDIR STEPS spare-N LIGHTHOUSE_URL STORE_PORT

Each step trains the tiny example model on a synthetic rollout batch that
depends only on the step number, so both modes do the same work.

- torchrun: a data-parallel rank of a static group. Rank 0 saves a snapshot
  every SNAPSHOT_EVERY steps; a started worker loads the newest one. When a
  worker dies, torchrun restarts every worker, which resume from it.
- torchft: one replica under a Manager; a restarted replica heals from a peer.
  As ``spare-N`` it builds everything first, then waits for WORKDIR/assign-N
  (which holds the replica number) before it joins: a warm spare.

Every worker appends "<step> <time>" to WORKDIR/progress-<id> after each step.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchft_overhead import synthetic_batch  # noqa: E402

from elastic_rl.atomic import write_file_atomic  # noqa: E402
from elastic_rl.model.gpt import build_gpt, init_model_parallel  # noqa: E402
from elastic_rl.spec.loading import load_spec  # noqa: E402
from elastic_rl.trainer.grpo import GrpoTrainer  # noqa: E402
from elastic_rl.trainer.lr_schedule import lr_lambda  # noqa: E402
from tests.trainer_doubles import FakeSoloQuorum  # noqa: E402

from harness import SPEC  # noqa: E402

# One optimizer step per rollout: 16 prompts x 16 samples, all in one global batch.
OVERRIDES = ["rollout.prompts_per_rollout=16", "trainer.global_batch_size=256", "trainer.replicas=2"]


class StaticGroup(FakeSoloQuorum):
    """The Manager's interface over a plain torch.distributed group: no quorum, every step commits."""

    def num_participants(self) -> int:
        return torch.distributed.get_world_size()

    def participating_rank(self) -> int:
        return torch.distributed.get_rank()

    def allreduce(self, tensor: torch.Tensor, reduce_op=torch.distributed.ReduceOp.SUM):
        return torch.distributed.all_reduce(tensor, op=reduce_op, async_op=True)


def build(spec):
    model = build_gpt(spec.model.toy_architecture(64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.trainer.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec.trainer, 10_000))
    return model, optimizer, scheduler


def record(workdir: Path, worker: str, step: int) -> None:
    with open(workdir / f"progress-{worker}", "a") as progress:
        progress.write(f"{step} {time.time()}\n")


def join_torchrun_group() -> None:
    """The default group, its store keys kept apart per restart: the agent's store outlives the
    workers, and a restarted group would otherwise read its dead predecessors' addresses."""
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    generation = torch.distributed.PrefixStore(f"restart-{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store)
    torch.distributed.init_process_group(
        "gloo", store=generation, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )


def run_torchrun(spec, workdir: Path, steps: int, snapshot_every: int) -> None:
    join_torchrun_group()
    init_model_parallel(1, spec.seed)
    rank = torch.distributed.get_rank()
    (workdir / f"pid-{rank}").write_text(str(os.getpid()))
    model, optimizer, scheduler = build(spec)
    snapshot = workdir / "snapshot.pt"
    step = 0
    if snapshot.exists():
        state = torch.load(snapshot, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        step = int(state["step"])
    group = StaticGroup(step)
    trainer = GrpoTrainer(spec, model, optimizer, scheduler, group, replica=rank)
    while group.current_step() < steps:
        step = group.current_step()
        trainer.step(trainer.prepare(step, synthetic_batch(256, step)), 0)
        record(workdir, f"rank{rank}", step)
        if rank == 0 and (step + 1) % snapshot_every == 0:
            state = {
                "model": model.state_dict(),
                "optim": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step + 1,
            }
            buffer = workdir / "snapshot.tmp"
            torch.save(state, buffer)
            write_file_atomic(snapshot, buffer.read_bytes())


def run_torchft(spec, workdir: Path, steps: int, identity: str, lighthouse: str, store_port: int) -> None:
    from torchft import Manager, ProcessGroupGloo

    from elastic_rl.trainer.heal_transport import LoopbackTransport

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
    init_model_parallel(1, spec.seed, init_method=f"tcp://127.0.0.1:{store_port}")
    model, optimizer, scheduler = build(spec)
    if identity.startswith("spare-"):
        assignment = workdir / f"assign-{identity.removeprefix('spare-')}"
        while not assignment.exists():
            time.sleep(0.01)
        replica = int(assignment.read_text())
    else:
        replica = int(identity)
    (workdir / f"pid-replica{replica}").write_text(str(os.getpid()))
    timeout = timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        load_state_dict=lambda s: (
            model.load_state_dict(s["model"]),
            optimizer.load_state_dict(s["optim"]),
            scheduler.load_state_dict(s["scheduler"]),
        ),
        state_dict=lambda: {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        },
        replica_id=f"bench-replica{replica}",
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        rank=0,
        world_size=1,
        use_async_quorum=False,
        init_sync=False,
        checkpoint_transport=LoopbackTransport(timeout),
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    trainer = GrpoTrainer(spec, model, optimizer, scheduler, manager, replica=replica)
    while manager.current_step() < steps:
        manager.start_quorum()
        step = manager.current_step()
        outcome = trainer.step(trainer.prepare(step, synthetic_batch(256, step)), 0)
        if outcome.committed:
            record(workdir, f"replica{replica}", step)
    manager.shutdown(wait=False)


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    mode, workdir, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    spec = load_spec(SPEC, OVERRIDES)
    if mode == "torchrun":
        run_torchrun(spec, workdir, steps, int(sys.argv[4]))
    else:
        run_torchft(spec, workdir, steps, sys.argv[4], sys.argv[5], int(sys.argv[6]))


if __name__ == "__main__":
    main()
