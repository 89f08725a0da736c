"""A replica's data-parallel ranks, sharded optimizer and a snapshot across layouts, started by
test_data_parallel.py.

    python -m tests.integration.data_parallel_worker OUT_DIR TP   (RANK, WORLD_SIZE=2 x TP, MASTER_* set)

The ranks form one replica of TP x DP=2 and train the tiny model for a few GRPO steps on the same
synthetic rollout three ways: with AdamW sharded across the two data-parallel ranks, with AdamW whole on
each, and (each tensor-parallel group alone) at DP=1. Then the sharded state is snapshotted and loaded
into a DP=1 replica's state (a whole AdamW), which takes one more step beside the unsharded one. Each
rank writes the largest differences of its own slices, relative to each tensor's largest entry.

The quorum is ``FakeSoloQuorum``: one replica, every step committed; the real Manager's side of the
step runs in the chaos test of a data-parallel job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch

from checkpoints.layout import snapshot_path
from checkpoints.rollout_log import RolloutBatch
from checkpoints.snapshot import SnapshotWriter, TrainingState, load_snapshot
from elastic_rl.model.gpt import init_model_parallel
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.loading import load_spec
from elastic_rl.trainer.grpo import GrpoTrainer
from tests.processes import SPEC
from tests.trainer_doubles import rollout_batch, solo_replica

SAMPLES, WIDTH, STEPS = 32, 24, 4
COMMON = [
    "rollout.prompts_per_rollout=4",
    "rollout.n_samples_per_prompt=8",
    f"trainer.global_batch_size={SAMPLES // STEPS}",
    "trainer.micro_batch_size=4",
    "trainer.lr=0.01",
]


def rollout(vocab: int) -> RolloutBatch:
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(2, 6, (SAMPLES,), generator=generator)
    responses = torch.randint(4, WIDTH - 6, (SAMPLES,), generator=generator)
    return rollout_batch(torch.randint(4, vocab, (SAMPLES, WIDTH), generator=generator), prompts, responses, generator)


def replica(
    tensor_parallel: int, data_parallel: int, shard: bool, initial: dict | None = None
) -> tuple[GrpoTrainer, TrainingState]:
    """A replica's trainer and state; ``initial``: its weights (each model built draws on the seeded RNG)."""
    layout = [f"trainer.tensor_parallel={tensor_parallel}", f"trainer.data_parallel={data_parallel}"]
    spec = load_spec(SPEC, [*COMMON, *layout, f"trainer.shard_optimizer={shard}"])
    model = ModelSource.from_spec(spec.model).build_policy()
    if initial is not None:
        model.load_state_dict(initial)
    return solo_replica(spec, model)


def train(trainer: GrpoTrainer, batch: RolloutBatch, steps: range) -> None:
    context = trainer.prepare(0, batch)
    for index in steps:
        assert trainer.step(context, index).committed


def largest_gap(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a.parameters(), b.parameters())
    )


def moments_gap(a: TrainingState, b: TrainingState) -> float:
    gaps = []
    for x, y in zip(a.model.parameters(), b.model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            mx, my = a.optimizer.state[x][key], b.optimizer.state[y][key]
            gaps.append(((mx - my).abs().max() / my.abs().max().clamp_min(1e-12)).item())
    return max(gaps)


def main() -> None:
    out, tp = Path(sys.argv[1]), int(sys.argv[2])
    torch.use_deterministic_algorithms(True)
    init_model_parallel(tp, seed=7)  # 2 x TP ranks: megatron's data-parallel groups hold two each
    sharded, sharded_state = replica(tp, 2, shard=True)
    initial = {name: v.clone() if torch.is_tensor(v) else v for name, v in sharded.model.state_dict().items()}
    whole, whole_state = replica(tp, 2, shard=False, initial=initial)
    alone, _ = replica(tp, 1, shard=False, initial=initial)
    batch = rollout(len(ModelSource.from_spec(sharded.spec.model).tokenizer))
    for trainer in (sharded, whole, alone):
        train(trainer, batch, range(STEPS - 1))
    result = {
        "sharded_vs_whole": largest_gap(sharded.model, whole.model),
        "dp2_vs_dp1": largest_gap(sharded.model, alone.model),
        "owned_states": len(sharded_state.optimizer.state),
        "all_states": len(whole_state.optimizer.state),
    }

    writer = SnapshotWriter(out, async_save=False)
    writer.save(sharded_state, step=STEPS - 1, last_rollout=0, spec_hash="")
    resumed, resumed_state = replica(tp, 1, shard=False, initial=initial)  # its weights come from the snapshot
    load_snapshot(resumed_state, snapshot_path(out, STEPS - 1), writer.group)
    result["loaded_weights_vs_whole"] = largest_gap(resumed.model, whole.model)
    result["loaded_moments_vs_whole"] = moments_gap(resumed_state, whole_state)
    train(resumed, batch, range(STEPS - 1, STEPS))
    train(whole, batch, range(STEPS - 1, STEPS))
    result["resumed_step_vs_whole"] = largest_gap(resumed.model, whole.model)
    (out / f"result.{torch.distributed.get_rank()}.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main()
