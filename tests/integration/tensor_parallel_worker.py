"""A replica of tensor-parallel ranks training pretrained models, started by test_tensor_parallel.py.

    python -m tests.integration.tensor_parallel_worker OUT_DIR NAME:SPEC:SP ...   (RANK, WORLD_SIZE=TP, MASTER_*)

The ranks form one replica of TP = WORLD_SIZE. For each NAME:SPEC:SP (a job spec whose model is a small
checkpoint; SP 1 turns trainer.sequence_parallel on where TP > 1) they train the model for three GRPO
steps on a synthetic rollout, its micro-batches cut by a token budget and packed (sequences of lengths
that are no multiple of TP); with algorithm.routing_replay the rollout holds a routing record of random
experts, which every pass replays. Rank 0 writes the gathered weights to OUT_DIR/NAME/weights.pt; every rank
writes the parameters it holds whole (not split over the ranks) to OUT_DIR/NAME/whole.<rank>.pt.

The quorum is ``FakeSoloQuorum``: one replica, every step committed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from elastic_rl import routing_record
from elastic_rl.model.gpt import ModelOptions, init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.source import ModelSource
from elastic_rl.routing_record import RoutingShape
from elastic_rl.spec.loading import load_spec
from tests.integration.data_parallel_worker import COMMON, rollout
from tests.trainer_doubles import solo_replica

STEPS = 3


def train(out: Path, spec_path: Path, sequence_parallel: bool) -> None:
    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    layout = [f"trainer.tensor_parallel={tp}", f"trainer.sequence_parallel={sequence_parallel and tp > 1}"]
    spec = load_spec(spec_path, [*COMMON, *layout, "trainer.max_tokens_per_micro_batch=60"])
    source = ModelSource.from_spec(spec.model)
    trainer, _ = solo_replica(spec, source.build_policy(ModelOptions.of(spec.trainer)))
    batch = rollout(len(source.tokenizer))
    if spec.algorithm.routing_replay:
        batch.routed_experts = random_routing(batch.tokens.shape, RoutingShape.of(source.architecture))
    context = trainer.prepare(0, batch)
    for index in range(STEPS):
        assert trainer.step(context, index).committed
    whole = {
        name: param.detach().clone()
        for name, param in trainer.model.named_parameters()
        if not getattr(param, "tensor_model_parallel", False)
    }
    out.mkdir(parents=True, exist_ok=True)
    torch.save(whole, out / f"whole.{rank}.pt")
    weights = full_state_dict(trainer.model)
    if rank == 0:
        torch.save(weights, out / "weights.pt")


def random_routing(tokens: torch.Size, shape: RoutingShape, seed: int = 9) -> torch.Tensor:
    """A routing record for every token: distinct experts drawn from ``seed``, as a batch stores it."""
    draws = torch.rand(*tokens, shape.layers, shape.experts, generator=torch.Generator().manual_seed(seed))
    chosen = draws.argsort(dim=-1)[..., : shape.per_token].to(torch.int16)
    return routing_record.stored(list(chosen), tokens[1], shape)


def main() -> None:
    out = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    init_model_parallel(int(os.environ["WORLD_SIZE"]), seed=5)
    for run in sys.argv[2:]:
        name, spec_path, sequence_parallel = run.split(":")
        train(out / name, Path(spec_path), sequence_parallel == "1")


if __name__ == "__main__":
    main()
