"""One rank of a megatron group that imports HF checkpoints, started by test_pretrained.py.

    python -m tests.integration.pretrained_worker OUT PP CHECKPOINT...   (RANK, WORLD_SIZE, MASTER_* set)

For each checkpoint: builds the policy from it in PP pipeline stages at TP =
WORLD_SIZE / PP (each rank reading its own slices of its own layers), records
the full-vocabulary logits of a fixed batch (the last stage's), gathers the
canonical state and exports it back (rank 0) to OUT/<name>/hf, with the logits
in OUT/<name>/logits.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from megatron.core import parallel_state

from elastic_rl.model.gpt import destroy_model_parallel, init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.packing import ModelInput
from elastic_rl.model.pipeline import run_micro_batches
from elastic_rl.model.source import ModelSource
from elastic_rl.model.token_scores import output_logits
from elastic_rl.model.vocab_parallel import gather_logits
from elastic_rl.spec.model import ModelSpec


@torch.no_grad()
def last_stage_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """The full-vocabulary logits of ``tokens``, on the last pipeline stage; None on the others."""
    logits = []

    def keep(_index: int, hidden: torch.Tensor) -> torch.Tensor:
        logits.append(gather_logits(output_logits(model, hidden)))
        return hidden.new_zeros(())

    run_micro_batches(model, [ModelInput(tokens, tokens, rows=len(tokens))], keep, backward=False)
    return logits[0] if logits else None


def main() -> None:
    out, pp, checkpoints = Path(sys.argv[1]), int(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
    tp = int(os.environ["WORLD_SIZE"]) // pp
    torch.use_deterministic_algorithms(True)
    init_model_parallel(tp, seed=3, pipeline_parallel=pp)
    for checkpoint in checkpoints:
        export_with_logits(checkpoint, out)
    destroy_model_parallel()


def export_with_logits(checkpoint: Path, out: Path) -> torch.nn.Module:
    """Import ``checkpoint`` into this rank's model, export it back (rank 0) to OUT/<name>/hf and save the
    logits of a fixed batch to OUT/<name>/logits.pt; return the model."""
    source = ModelSource.from_spec(ModelSpec(hf_checkpoint=checkpoint))
    model = source.build_policy().eval()
    tokens = torch.randint(0, source.architecture.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = last_stage_logits(model, tokens)
    state = full_state_dict(model)
    target = out / checkpoint.name
    if torch.distributed.get_rank() == 0:
        source.export(target / "hf", state)
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
        torch.save({"tokens": tokens, "logits": logits.cpu()}, target / "logits.pt")
    return model


if __name__ == "__main__":
    main()
