"""One rank of bench/context_parallel_bench.py: GRPO steps on one long sample, its tokens split over the
replica's context-parallel ranks.

    python bench/context_parallel_worker.py OUT LENGTH   (RANK, WORLD_SIZE = CP, MASTER_* set)

Builds a toy model of the long-context case's shape (hidden 256, 4 layers, 8 heads, 4 key/value heads,
FFN 768) at CP = WORLD_SIZE and trains it on samples of LENGTH tokens (a 16-token prompt), two a step,
one a micro-batch. The first step creates AdamW's state; the peak of the next ones is measured as the
growth of the process's peak resident memory over its resident memory before them. Writes OUT.<rank>.json:
the peak growth, the median step time of the measured steps, and rank 0 the old-policy log probs and
the weights after the first step (OUT.pt).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from pathlib import Path

import orjson
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from elastic_rl.model.gpt import init_model_parallel  # noqa: E402
from elastic_rl.model.megatron_state import full_state_dict  # noqa: E402
from elastic_rl.model.source import ModelSource  # noqa: E402
from elastic_rl.spec.loading import load_spec  # noqa: E402
from tests.trainer_doubles import rollout_batch, solo_replica  # noqa: E402

SHAPE = [
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=768",
    "model.max_position_embeddings=65536",
]
PROMPT = 16
MEASURED_STEPS = 2


def resident(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def main() -> None:
    out, length = Path(sys.argv[1]), int(sys.argv[2])
    context_parallel = int(os.environ["WORLD_SIZE"])
    torch.use_deterministic_algorithms(True)
    init_model_parallel(1, seed=5, context_parallel=context_parallel)
    settings = [
        *SHAPE,
        f"trainer.context_parallel={context_parallel}",
        f"rollout.prompts_per_rollout={1 + MEASURED_STEPS}",
        "rollout.n_samples_per_prompt=2",
        "trainer.global_batch_size=2",
        f"trainer.max_tokens_per_micro_batch={length}",
        "trainer.lr=0.001",
    ]
    spec = load_spec(REPO / "examples" / "tiny-grpo.yaml", settings)
    source = ModelSource.from_spec(spec.model)
    trainer, _ = solo_replica(spec, source.build_policy())
    generator = torch.Generator().manual_seed(1)
    samples = 2 * (1 + MEASURED_STEPS)
    tokens = torch.randint(4, len(source.tokenizer), (samples, length), generator=generator)
    batch = rollout_batch(tokens, torch.full((samples,), PROMPT), torch.full((samples,), length - PROMPT), generator)
    context = trainer.prepare(0, batch)
    assert trainer.step(context, 0).committed  # AdamW's state exists from here on
    rank = torch.distributed.get_rank()
    weights = full_state_dict(trainer.model)
    if rank == 0:
        torch.save({"old_logp": context.old_logp, "weights": weights}, out.with_suffix(".pt"))
    Path("/proc/self/clear_refs").write_text("5")
    before = resident("VmRSS")
    times = []
    for index in range(1, 1 + MEASURED_STEPS):
        started = time.perf_counter()
        assert trainer.step(context, index).committed
        times.append(time.perf_counter() - started)
    result = {"peak_growth_bytes": resident("VmHWM") - before, "step_s": statistics.median(times)}
    out.with_suffix(f".{rank}.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main()
