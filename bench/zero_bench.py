"""Benchmark: a trainer step with AdamW sharded across a replica's two data-parallel ranks, against whole.

    .venv/bin/python bench/zero_bench.py [--steps 6]

Starts two ranks of one replica (TP=1 x DP=2, gloo, one thread each) that train the tiny model and
SmolLM2-135M on a synthetic rollout, each way in turn in the same run (sharded, whole, sharded, whole,
to spread the machine's noise), and prints the median step time of each, their ratio, and the
optimizer state each rank holds. The quorum is one replica with nothing to all-reduce, as in
`tests/integration/data_parallel_worker.py`: the step measured is the replica's own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = {
    "tiny": ("examples/tiny-grpo.yaml", []),
    "SmolLM2-135M": ("examples/smollm2-math.yaml", []),
}


def rank_main(steps: int) -> None:
    import torch

    from elastic_rl.model.gpt import init_model_parallel
    from elastic_rl.model.source import ModelSource
    from elastic_rl.spec.loading import load_spec
    from tests.integration import data_parallel_worker as worker
    from tests.trainer_doubles import solo_replica

    torch.set_num_threads(1)
    init_model_parallel(1, seed=7)
    rank = torch.distributed.get_rank()
    for model_name, (spec_path, overrides) in MODELS.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        held: dict[bool, int] = {}
        for shard in (True, False, True, False):
            spec = load_spec(
                REPO / spec_path,
                [*worker.COMMON, *overrides, "trainer.data_parallel=2", f"trainer.shard_optimizer={shard}"],
            )
            source = ModelSource.from_spec(spec.model)
            model = source.build_policy()
            trainer, state = solo_replica(spec, model)
            context = trainer.prepare(0, worker.rollout(source.architecture.vocab_size))
            for index in range(steps):
                torch.distributed.barrier()
                started = time.perf_counter()
                trainer.step(context, index % worker.STEPS)
                if index > 0:  # the first step makes AdamW's state
                    times[shard].append(time.perf_counter() - started)
            moments = state.optimizer.state.values()
            held[shard] = sum(t.numel() * t.element_size() for s in moments for t in s.values() if t.dim() > 0)
        if rank == 0:
            sharded, whole = statistics.median(times[True]), statistics.median(times[False])
            print(
                f"| {model_name} | {whole:.3f} s | {sharded:.3f} s | {sharded / whole:.2f} | "
                f"{held[False] / 2**20:.1f} MiB | {held[True] / 2**20:.1f} MiB |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.steps)
        return
    from elastic_rl.net import LOOPBACK, free_port

    print("| model | step, AdamW whole | step, AdamW sharded | sharded / whole | moments per rank, whole | sharded |")
    print("|---|---|---|---|---|---|")
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", __file__, "--rank", "--steps", str(args.steps)],
            cwd=REPO,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
            },  # fmt: skip
        )
        for r in range(2)
    ]
    for process in ranks:
        process.wait()


if __name__ == "__main__":
    main()
