"""Benchmark: a trainer step of a replica in two pipeline stages, against the same replica on one.

    .venv/bin/python bench/pipeline_bench.py [--steps 6] [--micro-batch 2]

Trains the tiny model and SmolLM2-135M on a synthetic rollout (that of
`tests/integration/data_parallel_worker.py`: 8 samples a step) as one rank (PP=1) and as two ranks
of one replica (PP=2: megatron's 1F1B schedule, gloo, activations sent between the stages), one
thread per rank, alternately twice each in the same run to spread the machine's noise. Prints each
layout's median step time and their ratio. The quorum is one replica with nothing to all-reduce: the
step measured is the replica's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = {
    "tiny": "examples/tiny-grpo.yaml",
    "SmolLM2-135M": "examples/smollm2-math.yaml",
}


def rank_main(steps: int, micro_batch: int, pipeline_parallel: int) -> None:
    import torch

    from elastic_rl.model.gpt import init_model_parallel
    from elastic_rl.model.source import ModelSource
    from elastic_rl.spec.loading import load_spec
    from tests.integration import data_parallel_worker as worker
    from tests.trainer_doubles import solo_replica

    torch.set_num_threads(1)
    init_model_parallel(1, seed=7, pipeline_parallel=pipeline_parallel)
    for model_name, spec_path in MODELS.items():
        layout = [f"trainer.pipeline_parallel={pipeline_parallel}", f"trainer.micro_batch_size={micro_batch}"]
        spec = load_spec(REPO / spec_path, [*worker.COMMON, *layout])
        source = ModelSource.from_spec(spec.model)
        model = source.build_policy()
        trainer, _ = solo_replica(spec, model)
        context = trainer.prepare(0, worker.rollout(source.architecture.vocab_size))
        times = []
        for index in range(steps):
            torch.distributed.barrier()
            started = time.perf_counter()
            trainer.step(context, index % worker.STEPS)
            if index > 0:  # the first step makes AdamW's state
                times.append(time.perf_counter() - started)
        if torch.distributed.get_rank() == 0:
            print(json.dumps({"model": model_name, "times": times}), flush=True)


def run_layout(pipeline_parallel: int, steps: int, micro_batch: int) -> dict[str, list[float]]:
    from elastic_rl.net import LOOPBACK, free_port

    port = str(free_port())
    command = [sys.executable, "-W", "ignore", __file__, "--rank", str(pipeline_parallel)]
    command += ["--steps", str(steps), "--micro-batch", str(micro_batch)]
    ranks = [
        subprocess.Popen(
            command,
            cwd=REPO,
            stdout=subprocess.PIPE,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(pipeline_parallel),
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
            },  # fmt: skip
        )
        for r in range(pipeline_parallel)
    ]
    outputs = [process.communicate()[0] for process in ranks]
    lines = [json.loads(line) for line in outputs[0].decode().splitlines() if line.startswith("{")]
    return {line["model"]: line["times"] for line in lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch (8 a step)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank of this pipeline size
    args = parser.parse_args()
    if args.rank:
        rank_main(args.steps, args.micro_batch, args.rank)
        return
    times: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
    for pipeline_parallel in (1, 2, 1, 2):
        for model, measured in run_layout(pipeline_parallel, args.steps, args.micro_batch).items():
            times[pipeline_parallel].setdefault(model, []).extend(measured)
    print("| model | step, PP=1 (one rank) | step, PP=2 (two ranks) | PP=2 / PP=1 |")
    print("|---|---|---|---|")
    for model in MODELS:
        one, two = statistics.median(times[1][model]), statistics.median(times[2][model])
        print(f"| {model} | {one:.3f} s | {two:.3f} s | {two / one:.2f} |")


if __name__ == "__main__":
    main()
