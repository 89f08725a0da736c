"""A replica split into pipeline stages, started by test_pipeline_parallel.py.

    python -m tests.integration.pipeline_worker OUT_DIR TP PP [SNAPSHOT]   (RANK, WORLD_SIZE=TP x PP, MASTER_* set)

The ranks form one replica of TP x PP and train the tiny model, its embedding tied to its output
layer, for a few GRPO steps with a KL reference on one synthetic rollout, in micro-batches cut by a
token budget (so a step runs several through megatron's schedule, each of its own shape). They write
into OUT_DIR:

- ``metrics.json``: each step's loss, grad norm and metric sums, and the old policy's log probs;
- ``state.pt``: the trained weights in the TP=1, PP=1 layout, and ``tied_copy.pt``, the last stage's
  copy of the embedding;
- ``snapshot/``: a snapshot of the trained replica;
- ``rank.<rank>.json``: the parameters the rank holds and those the memory plan counts for it; with
  SNAPSHOT (another layout's snapshot folder, trained the same way), the largest difference of the
  rank's weights and moments loaded from it to its own trained ones.

The quorum is ``FakeSoloQuorum``: one replica, every step committed.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import orjson
import torch
from megatron.core import parallel_state

from checkpoints.layout import snapshot_path
from checkpoints.snapshot import SnapshotWriter, TrainingState, load_snapshot
from elastic_rl.memory_plan import model_shape, spec_architecture
from elastic_rl.model.gpt import init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.loading import load_spec
from elastic_rl.trainer.grpo import GrpoTrainer
from policies.memory import Layout, stage_parameters
from tests.integration.data_parallel_worker import rollout
from tests.processes import SPEC
from tests.trainer_doubles import solo_replica

STEPS = 3
SETTINGS = [
    "rollout.prompts_per_rollout=4",
    "rollout.n_samples_per_prompt=8",
    "trainer.global_batch_size=8",
    "trainer.max_tokens_per_micro_batch=48",
    "trainer.lr=0.01",
    "algorithm.kl_coef=0.05",
]


def replica(tensor_parallel: int) -> tuple[GrpoTrainer, TrainingState]:
    """The replica's trainer and state; its stages are megatron's pipeline groups."""
    spec = load_spec(
        SPEC,
        [
            *SETTINGS,
            f"trainer.tensor_parallel={tensor_parallel}",
            f"trainer.pipeline_parallel={parallel_state.get_pipeline_model_parallel_world_size()}",
        ],
    )
    source = ModelSource.from_spec(spec.model)
    source = replace(source, architecture=replace(source.architecture, tie_embeddings=True))
    model = source.build_policy()
    reference = source.build_reference(model, "initial")
    return solo_replica(spec, model, reference)


def largest_gaps(a: TrainingState, b: TrainingState) -> dict[str, float]:
    """Largest relative difference of ``a``'s weights and moments to ``b``'s (the same layout)."""
    weights, moments = [0.0], [0.0]
    for x, y in zip(a.model.parameters(), b.model.parameters()):
        weights.append(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item())
        for key in ("exp_avg", "exp_avg_sq"):
            mx, my = a.optimizer.state[x][key], b.optimizer.state[y][key]
            moments.append(((mx - my).abs().max() / my.abs().max().clamp_min(1e-12)).item())
    return {"weights": max(weights), "moments": max(moments)}


def main() -> None:
    out, tp, pp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    loaded_from = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    torch.use_deterministic_algorithms(True)
    init_model_parallel(tp, seed=7, pipeline_parallel=pp)
    trainer, state = replica(tp)
    batch = rollout(len(ModelSource.from_spec(trainer.spec.model).tokenizer))
    context = trainer.prepare(0, batch)
    for index in range(STEPS):
        assert trainer.step(context, index).committed
    weights = full_state_dict(state.model)
    rank = torch.distributed.get_rank()
    if rank == 0:
        metrics = {**context.metrics.values, "old_logp": context.old_logp.tolist()}
        (out / "metrics.json").write_bytes(orjson.dumps(metrics))
        torch.save(weights, out / "state.pt")
    if pp > 1 and parallel_state.is_pipeline_last_stage():
        copy = state.model.output_layer.weight.detach()
        rows = [torch.empty_like(copy) for _ in range(tp)]  # its slices of the vocabulary
        torch.distributed.all_gather(rows, copy, group=parallel_state.get_tensor_model_parallel_group())
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            torch.save(torch.cat(rows), out / "tied_copy.pt")
    writer = SnapshotWriter(out / "snapshot", async_save=False)
    writer.save(state, step=STEPS, last_rollout=0, spec_hash="")
    stage = parallel_state.get_pipeline_model_parallel_rank()
    shape = model_shape(replace(spec_architecture(trainer.spec), tie_embeddings=True))
    result = {
        "parameters": sum(p.numel() for p in state.model.parameters()),
        "accounted": stage_parameters(shape, Layout(tp, pp))[stage],
    }
    if loaded_from is not None:
        _, resumed = replica(tp)
        load_snapshot(resumed, snapshot_path(loaded_from, STEPS), writer.group)
        result["loaded"] = largest_gaps(resumed, state)
    (out / f"rank.{rank}.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main()
