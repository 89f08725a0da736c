"""Benchmark: context parallelism (trainer.context_parallel) on CPU, and the plan's estimate for long
sequences on GPUs.

    .venv/bin/python bench/context_parallel_bench.py [--lengths 2048,4096,8192]

1. One sample of each length trained at CP=1 (one process) and CP=2 (two processes, one core each),
   the toy model of ``context_parallel_worker.py``: the largest gap of the old-policy log probs and of
   the weights after one AdamW step (CP=2 against CP=1), each rank's peak memory growth over a step
   (glibc's blocks from 64 KiB mapped one by one, so that resident memory follows the live tensors), and
   the median step time. Then CP=2 at 1.8 times the longest length, whose per-rank peak should stay
   within CP=1's at the longest.
2. The plan's estimate (``policies.memory``) of one rank of the Llama 3.2 1B shape at 64k and 128k
   tokens, CP=1, 2 and 4: bf16 autocast over fp32 AdamW (counted as fp32), full recomputation, the
   logits in chunks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from elastic_rl.net import LOOPBACK, free_port  # noqa: E402
from policies.memory import (  # noqa: E402
    FP32_WHOLE,
    GIB,
    LOGITS_BUDGET_BYTES,
    ActivationLayout,
    Kept,
    Layout,
    ModelShape,
    rank_memory,
)

WORKER = REPO / "bench" / "context_parallel_worker.py"
LLAMA_1B = ModelShape(128256, 2048, 16, 32, 8, 64, 8192, tie_embeddings=True)


def run(out: Path, length: int, context_parallel: int) -> list[dict]:
    port = free_port()
    processes = []
    for rank in range(context_parallel):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(context_parallel),
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            # Large blocks mapped and unmapped one by one, so resident memory follows what is alive.
            "MALLOC_MMAP_THRESHOLD_": "65536",
        }
        command = [sys.executable, "-W", "ignore", str(WORKER), str(out), str(length)]
        processes.append(subprocess.Popen(command, cwd=REPO, env=env))
    for process in processes:
        if process.wait(timeout=1800) != 0:
            raise RuntimeError(f"{WORKER.name} at CP={context_parallel}, {length} tokens: exit {process.returncode}")
    return [orjson.loads(out.with_suffix(f".{rank}.json").read_bytes()) for rank in range(context_parallel)]


def largest_gap(one: dict, two: dict) -> float:
    return max(((one[name] - two[name]).abs().max() / one[name].abs().max()).item() for name in one)


def cpu_table(lengths: list[int], scratch: Path) -> None:
    print(
        "| tokens | CP=1: peak growth, step | CP=2: peak growth per rank, step | log-prob gap | weight gap (relative) |"
    )
    print("|---|---|---|---|---|")
    for length in lengths:
        one = run(scratch / f"cp1-{length}", length, 1)[0]
        two = run(scratch / f"cp2-{length}", length, 2)
        whole, split = (torch.load(scratch / f"cp{size}-{length}.pt") for size in (1, 2))
        logp_gap = (whole["old_logp"] - split["old_logp"]).abs().max().item()
        peak = max(rank["peak_growth_bytes"] for rank in two)
        step = max(rank["step_s"] for rank in two)
        print(
            f"| {length:,} | {one['peak_growth_bytes'] / 2**20:.0f} MiB, {one['step_s']:.2f} s | "
            f"{peak / 2**20:.0f} MiB, {step:.2f} s | {logp_gap:.1e} | "
            f"{largest_gap(whole['weights'], split['weights']):.1e} |"
        )


def equal_memory_line(longest: int, scratch: Path) -> None:
    """CP=2 at 1.8 times the longest length against CP=1 at it (measured by ``cpu_table``): the per-rank
    peak of each."""
    one = orjson.loads((scratch / f"cp1-{longest}.0.json").read_bytes())
    longer = int(1.8 * longest)
    peak = max(rank["peak_growth_bytes"] for rank in run(scratch / f"cp2-{longer}", longer, 2))
    print(
        f"CP=2 at {longer:,} tokens (1.8x): {peak / 2**20:.0f} MiB a rank, against CP=1 at {longest:,}: "
        f"{one['peak_growth_bytes'] / 2**20:.0f} MiB ({peak / one['peak_growth_bytes']:.2f} of it)"
    )


def plan_table() -> None:
    held = ActivationLayout(kept=Kept.INPUTS, logits_cap_bytes=LOGITS_BUDGET_BYTES)
    sizes = (1, 2, 4)
    print("| Llama 3.2 1B, one sequence | " + " | ".join(f"CP={cp}" for cp in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for tokens in (65536, 131072):
        totals = [
            rank_memory(LLAMA_1B, Layout(context_parallel=cp), FP32_WHOLE, tokens, tokens, 0, held).total / GIB
            for cp in sizes
        ]
        print(f"| {tokens:,} tokens | " + " | ".join(f"{total:.1f} GiB" for total in totals) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192")
    args = parser.parse_args()
    lengths = [int(length) for length in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        cpu_table(lengths, Path(scratch))
        print()
        equal_memory_line(max(lengths), Path(scratch))
    print()
    plan_table()


if __name__ == "__main__":
    main()
