"""Benchmark: a trainer step of a mixture of experts against a dense model of the same active parameters.

    .venv/bin/python bench/moe_bench.py [--steps 6]

Two sizes of random Qwen3-family checkpoints, each as a mixture (Qwen3-MoE: 8 experts, 2 per token)
and as a dense model whose MLP is as wide as two experts (so a token meets the same number of MLP
parameters), both with the toy tokenizer. One rank, one thread, trains each on the synthetic rollout
of `tests/integration/data_parallel_worker.py` (8 samples a step, micro-batches of 4), the two
alternately twice in one run; prints the median step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SIZES = {  # name: (hidden, layers, heads, expert width)
    "tiny (hidden 64)": (64, 2, 4, 64),
    "small (hidden 512)": (512, 4, 8, 512),
}
EXPERTS, PER_TOKEN = 8, 2


def checkpoints(root: Path, name: str, hidden: int, layers: int, heads: int, expert_width: int) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from elastic_rl.model.tokenizer import as_transformers, build_tokenizer

    tokenizer = as_transformers(build_tokenizer())
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": hidden // heads,
        "max_position_embeddings": 64,
    }
    configs = {
        "moe": Qwen3MoeConfig(
            **common,
            intermediate_size=PER_TOKEN * expert_width,
            num_experts=EXPERTS,
            num_experts_per_tok=PER_TOKEN,
            moe_intermediate_size=expert_width,
            norm_topk_prob=True,
        ),
        "dense": Qwen3Config(**common, intermediate_size=PER_TOKEN * expert_width),
    }
    folders = {}
    for kind, config in configs.items():
        folder = root / f"{name.split()[0]}-{kind}"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[kind] = folder
    return folders


def step_times(checkpoint: Path, steps: int) -> list[float]:

    from elastic_rl.model.source import ModelSource
    from elastic_rl.spec.loading import load_spec
    from elastic_rl.spec.model import ModelSpec
    from tests.integration import data_parallel_worker as worker
    from tests.trainer_doubles import solo_replica

    spec = load_spec(REPO / "examples/tiny-grpo.yaml", worker.COMMON)
    source = ModelSource.from_spec(ModelSpec(hf_checkpoint=checkpoint))
    model = source.build_policy()
    trainer, _ = solo_replica(spec, model)
    return timed_steps(trainer, worker.rollout(len(source.tokenizer)), steps)


def timed_steps(trainer, batch, steps: int) -> list[float]:
    """The seconds of each of ``steps`` steps on ``batch`` but the first (which makes AdamW's state)."""
    from tests.integration import data_parallel_worker as worker

    context = trainer.prepare(0, batch)
    times = []
    for index in range(steps):
        started = time.perf_counter()
        trainer.step(context, index % worker.STEPS)
        if index > 0:
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    import torch

    from elastic_rl.model.gpt import init_model_parallel
    from elastic_rl.net import LOOPBACK, free_port

    torch.set_num_threads(1)
    init_model_parallel(1, seed=7, init_method=f"tcp://{LOOPBACK}:{free_port()}")
    print(f"| model | step, dense | step, MoE ({EXPERTS} experts, {PER_TOKEN} per token) | MoE / dense |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name, size in SIZES.items():
            folders = checkpoints(Path(root), name, *size)
            times: dict[str, list[float]] = {"dense": [], "moe": []}
            for kind in ("dense", "moe", "dense", "moe"):
                times[kind] += step_times(folders[kind], args.steps)
            dense, moe = statistics.median(times["dense"]), statistics.median(times["moe"])
            print(f"| {name} | {dense:.3f} s | {moe:.3f} s | {moe / dense:.2f} |", flush=True)


if __name__ == "__main__":
    main()
