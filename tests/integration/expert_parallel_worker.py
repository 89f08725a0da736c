"""Expert parallelism inside a replica, started by test_moe.py.

    python -m tests.integration.expert_parallel_worker OUT_DIR SPEC CHECKPOINT...   (RANK, WORLD_SIZE=2, MASTER_* set)

The two ranks form one replica of DP=2. First each CHECKPOINT (a small random mixture of experts) is
imported at EP=2, each rank reading its own two of each layer's four experts: rank 0 exports the
gathered state to OUT_DIR/<name>/hf and saves the logits of a fixed batch to OUT_DIR/<name>/logits.pt.
Then the policy of SPEC (a job spec whose model is such a checkpoint) trains a few GRPO steps on one
synthetic rollout at EP=1 (every rank holds every expert) and at EP=2 (the dispatcher sends each token
to its experts' rank), its micro-batches cut by a token budget, so the ranks' micro-batches differ in
number and shape. The EP=2 state is snapshotted, takes one
more step, and the snapshot is loaded at EP=1, which takes the same step. Rank 0 writes the largest
differences, relative to each tensor's largest entry, to OUT_DIR/result.json.

The quorum is ``FakeSoloQuorum``: one replica, every step committed; the real Manager's side of the
step runs in the chaos test of a mixture-of-experts job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch
from megatron.core import parallel_state

from checkpoints.layout import snapshot_path
from checkpoints.snapshot import SnapshotWriter, TrainingState, load_snapshot
from elastic_rl.model.gpt import init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.loading import load_spec
from elastic_rl.trainer.grpo import GrpoTrainer
from tests.integration.data_parallel_worker import COMMON, STEPS, rollout, train
from tests.integration.pretrained_worker import export_with_logits
from tests.trainer_doubles import solo_replica

SEED = 7


def join(expert_parallel: int) -> None:
    """(Re)build megatron's groups for DP=2 at ``expert_parallel``; the process group stays."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_model_parallel(1, seed=SEED, expert_parallel=expert_parallel)


def replica(spec_path: Path, expert_parallel: int) -> tuple[GrpoTrainer, TrainingState]:
    overrides = [
        *COMMON,
        "trainer.data_parallel=2",
        f"trainer.expert_parallel={expert_parallel}",
        "trainer.shard_optimizer=false",
        "trainer.max_tokens_per_micro_batch=40",
    ]
    spec = load_spec(spec_path, overrides)
    model = ModelSource.from_spec(spec.model).build_policy()
    return solo_replica(spec, model)


def largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(((a[name] - b[name]).abs().max() / b[name].abs().max().clamp_min(1e-12)).item() for name in a)


@torch.no_grad()
def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of the last step (clipped, as the optimizer took them), gathered as ``full_state_dict``
    gathers the weights: each parameter holds its gradient while it gathers."""
    weights = [param.detach().clone() for param in model.parameters()]
    for param in model.parameters():
        param.copy_(param.grad)
    gradients = full_state_dict(model)
    for param, weight in zip(model.parameters(), weights):
        param.copy_(weight)
    return gradients


def local_experts(model: torch.nn.Module) -> int:
    return len(model.decoder.layers[0].mlp.experts.local_experts)


def micro_batches_per_step(trainer: GrpoTrainer, batch) -> list[list[int]]:
    """Each rank's micro-batches in each step: where they differ, a rank ran empty ones to match."""
    size = trainer.spec.trainer.global_batch_size
    own = [
        len(trainer._micro_batches(batch, trainer._data_rank_part(torch.arange(step * size, (step + 1) * size))))
        for step in range(STEPS)
    ]
    ranks: list[list[int]] = [[]] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, own)
    return ranks


def main() -> None:
    out, spec_path, checkpoints = Path(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
    torch.use_deterministic_algorithms(True)
    join(expert_parallel=2)
    for checkpoint in checkpoints:
        model = export_with_logits(checkpoint, out)
        assert local_experts(model) == model.config.num_moe_experts // 2

    join(expert_parallel=1)
    whole, _ = replica(spec_path, expert_parallel=1)
    batch = rollout(len(ModelSource.from_spec(whole.spec.model).tokenizer))
    train(whole, batch, range(1))
    whole_gradients = full_gradients(whole.model)
    train(whole, batch, range(1, STEPS - 1))
    whole_weights = full_state_dict(whole.model)

    join(expert_parallel=2)
    split, split_state = replica(spec_path, expert_parallel=2)
    train(split, batch, range(1))
    result = {
        "local_experts": local_experts(split.model),
        "first_gradients_ep2_vs_ep1": largest_gap(full_gradients(split.model), whole_gradients),
    }
    train(split, batch, range(1, STEPS - 1))
    # In learning rates: AdamW's first step moves an entry by about the learning rate whatever its gradient,
    # so where a gradient is near 0 the two orders of the same sums move it differently.
    weights = full_state_dict(split.model)
    result["weights_ep2_vs_ep1_in_lr"] = (
        max((weights[n] - whole_weights[n]).abs().max().item() for n in weights) / split.spec.trainer.lr
    )
    writer = SnapshotWriter(out, async_save=False)
    writer.save(split_state, step=STEPS - 1, last_rollout=0, spec_hash="")
    snapshot_weights = full_state_dict(split.model)
    train(split, batch, range(STEPS - 1, STEPS))
    split_next = full_state_dict(split.model)

    join(expert_parallel=1)
    resumed, resumed_state = replica(spec_path, expert_parallel=1)
    load_snapshot(resumed_state, snapshot_path(out, STEPS - 1), writer.group)
    result["loaded_vs_saved"] = largest_gap(full_state_dict(resumed.model), snapshot_weights)
    train(resumed, batch, range(STEPS - 1, STEPS))
    result["resumed_step_vs_ep2"] = largest_gap(full_state_dict(resumed.model), split_next)
    result["micro_batches_per_step"] = micro_batches_per_step(split, batch)
    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main()
