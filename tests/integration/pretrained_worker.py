"""One rank of a megatron group that imports HF checkpoints, started by test_pretrained.py.

    python -m tests.integration.pretrained_worker OUT CHECKPOINT...   (RANK, WORLD_SIZE, MASTER_* set)

For each checkpoint: builds the policy from it at TP = WORLD_SIZE (each rank
reading its own slices), records the full-vocabulary logits of a fixed batch,
gathers the canonical state and exports it back (rank 0) to OUT/<name>/hf,
with the logits in OUT/<name>/logits.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from elastic_rl.model.gpt import destroy_model_parallel, forward_gpt, init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.source import ModelSource
from elastic_rl.model.vocab_parallel import gather_logits
from elastic_rl.spec.model import ModelSpec


def main() -> None:
    out, checkpoints = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    tp = int(os.environ["WORLD_SIZE"])
    rank0 = int(os.environ["RANK"]) == 0
    torch.use_deterministic_algorithms(True)
    init_model_parallel(tp, seed=3)
    for checkpoint in checkpoints:
        source = ModelSource.from_spec(ModelSpec(hf_checkpoint=checkpoint))
        model = source.build_policy().eval()
        tokens = torch.randint(0, source.architecture.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = gather_logits(forward_gpt(model, tokens))
        state = full_state_dict(model)
        if rank0:
            target = out / checkpoint.name
            source.export(target / "hf", state)
            torch.save({"tokens": tokens, "logits": logits.cpu()}, target / "logits.pt")
    destroy_model_parallel()


if __name__ == "__main__":
    main()
