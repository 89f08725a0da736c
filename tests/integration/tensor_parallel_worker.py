"""A replica of tensor-parallel ranks training a pretrained model, started by test_tensor_parallel.py.

    python -m tests.integration.tensor_parallel_worker OUT_DIR SPEC   (RANK, WORLD_SIZE=TP, MASTER_* set)

The ranks form one replica of TP = WORLD_SIZE and train the model of SPEC (a job spec whose model is a
small checkpoint) for three GRPO steps on a synthetic rollout. Rank 0 writes the gathered weights to
OUT_DIR/weights.pt; every rank writes the parameters it holds whole (not split over the ranks) to
OUT_DIR/whole.<rank>.pt.

The quorum is ``FakeSoloQuorum``: one replica, every step committed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from elastic_rl.model.gpt import ModelOptions, init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.loading import load_spec
from tests.integration.data_parallel_worker import COMMON, rollout
from tests.trainer_doubles import solo_replica

STEPS = 3


def main() -> None:
    out, spec_path = Path(sys.argv[1]), Path(sys.argv[2])
    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.use_deterministic_algorithms(True)
    init_model_parallel(tp, seed=5)
    spec = load_spec(spec_path, [*COMMON, f"trainer.tensor_parallel={tp}"])
    source = ModelSource.from_spec(spec.model)
    trainer, _ = solo_replica(spec, source.build_policy(ModelOptions.of(spec.trainer)))
    context = trainer.prepare(0, rollout(len(source.tokenizer)))
    for index in range(STEPS):
        assert trainer.step(context, index).committed
    whole = {
        name: param.detach().clone()
        for name, param in trainer.model.named_parameters()
        if not getattr(param, "tensor_model_parallel", False)
    }
    torch.save(whole, out / f"whole.{rank}.pt")
    weights = full_state_dict(trainer.model)
    if rank == 0:
        torch.save(weights, out / "weights.pt")


if __name__ == "__main__":
    main()
