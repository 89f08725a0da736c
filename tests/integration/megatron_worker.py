"""One rank of a megatron model-parallel group, started by test_model.py.

    python -m tests.integration.megatron_worker OUT_DIR   (RANK, WORLD_SIZE, MASTER_* set)

Builds the tiny model at TP = WORLD_SIZE, records its full-vocabulary logits on
a fixed batch, exports it to OUT_DIR/hf (rank 0), then trains a few AdamW steps
on the batch with the vocabulary-parallel log-likelihood and records the losses
and entropies. Rank 0 writes OUT_DIR/result.json and OUT_DIR/logits.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import orjson
import torch

from elastic_rl.model.gpt import destroy_model_parallel, forward_gpt, init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.source import ModelSource
from elastic_rl.model.vocab_parallel import entropy, gather_logits, token_log_probs
from elastic_rl.spec.model import ModelSpec

SPEC = ModelSpec(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96)
TRAIN_STEPS = 25


def main() -> None:
    out = Path(sys.argv[1])
    tp = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    torch.use_deterministic_algorithms(True)
    init_model_parallel(tp, seed=11)
    source = ModelSource.from_spec(SPEC)
    model = source.build_policy()
    batch = torch.randint(4, len(source.tokenizer), (4, 24), generator=torch.Generator().manual_seed(0))

    with torch.no_grad():
        logits = gather_logits(forward_gpt(model, batch))
    state = full_state_dict(model)
    if rank == 0:
        source.export(out / "hf", state)
        torch.save({"tokens": batch, "logits": logits}, out / "logits.pt")

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, entropies = [], []
    for _ in range(TRAIN_STEPS):
        shard_logits = forward_gpt(model, batch[:, :-1])
        loss = -token_log_probs(shard_logits, batch[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        entropies.append(entropy(shard_logits.detach()).mean().item())
    if rank == 0:
        (out / "result.json").write_bytes(orjson.dumps({"losses": losses, "entropies": entropies}))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
