"""Long sequences on one GPU, started by test_gpu_long_context.py.

    python -m tests.gpu.long_context_worker OUT_DIR   (RANK=0, WORLD_SIZE=1, MASTER_* set, on a GPU slot)

- ``long``: the Llama 3.2 1B shape (random weights, tied embeddings) in bf16 autocast, as the trainer
  builds it (fused attention, chunked log probs), trains one AdamW step on an 8,192-token sequence's
  response-half log probs; the CUDA allocator's peak growth from before the model was built, against
  ``erl plan``'s estimate for that rank.
- ``packing``: the tiny model in bf16 autocast, a trainer on packed micro-batches against one on padded
  ones (``long_sequence_worker``'s comparison, on CUDA).

Writes OUT_DIR/result.json as each part finishes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch

from elastic_rl.architecture import Architecture
from elastic_rl.model.gpt import ModelOptions, build_gpt, decoder_states, init_model_parallel
from elastic_rl.model.packing import ModelInput
from elastic_rl.model.token_scores import Entropy, token_scores
from policies.devices import Precision
from policies.memory import FP32_WHOLE, LOGITS_BUDGET_BYTES, ActivationLayout, Layout, ModelShape, rank_memory
from tests.integration.long_sequence_worker import compare, first_step
from tests.processes import SPEC

TOKENS = 8192
LLAMA_1B = Architecture("llama", 128256, 2048, 16, 32, 8, 64, 8192, TOKENS, 500000.0, 1e-5, tie_embeddings=True)


def long_sequence() -> dict:
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = build_gpt(LLAMA_1B, 1, ModelOptions(precision=Precision.BF16)).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, LLAMA_1B.vocab_size, (1, TOKENS + 1), device="cuda")
    half = TOKENS // 2
    item = ModelInput(tokens[:, :-1], tokens[:, -half:], rows=1, first=TOKENS - half)
    logp, _ = token_scores(model, decoder_states(model, item), item.targets, 1.0, Entropy.METRIC)
    logp.sum().backward()
    optimizer.step()
    torch.cuda.synchronize()
    shape = ModelShape(LLAMA_1B.vocab_size, 2048, 16, 32, 8, 64, 8192, tie_embeddings=True)
    planned = rank_memory(
        shape,
        Layout(),
        FP32_WHOLE,
        TOKENS,
        TOKENS,
        frozen_models=0,
        held=ActivationLayout(fused_attention=True, logits_cap_bytes=LOGITS_BUDGET_BYTES),
    )
    return {
        "finite": bool(torch.isfinite(logp).all()),
        "peak_growth_bytes": torch.cuda.max_memory_allocated() - before,
        "planned_bytes": planned.total,
    }


def main() -> None:
    out = Path(sys.argv[1])
    init_model_parallel(1, seed=7)
    results: dict[str, dict] = {}
    results["long"] = long_sequence()
    (out / "result.json").write_bytes(orjson.dumps(results))
    torch.cuda.empty_cache()
    bf16 = ["trainer.dtype=bf16"]
    packed = first_step(SPEC, bf16)
    padded = first_step(SPEC, [*bf16, "trainer.packing=false"], packed["initial"])
    results["packing"] = compare(packed, padded)
    (out / "result.json").write_bytes(orjson.dumps(results))


if __name__ == "__main__":
    main()
