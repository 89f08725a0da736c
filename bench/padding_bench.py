"""Benchmark: padding in the trainer's micro-batches, fixed sample counts against token budgets.

    .venv/bin/python bench/padding_bench.py WORKDIR [BUDGET ...]     # a job's work dir, e.g. of `make smollm2`

Reads the rollout batches left in the job's rollout log and cuts each optimizer step's samples
the way the trainer does: `trainer.micro_batch_size` samples at a time padded to the batch's
width (before this change), the same padded to each micro-batch's longest sample (now, without
a budget), and grouped by length under each `trainer.max_tokens_per_micro_batch` budget. Prints
the share of token slots that are padding, and the number of micro-batches, for each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from checkpoints.layout import SPEC_FILE, committed_rollouts  # noqa: E402
from checkpoints.rollout_log import read_rollout  # noqa: E402
from elastic_rl.trainer.micro_batches import fixed_micro_batches, padding_fraction, token_budget_micro_batches  # noqa: E402


def main() -> None:
    workdir = Path(sys.argv[1])
    budgets = [int(b) for b in sys.argv[2:]] or [256, 512]
    trainer = orjson.loads((workdir / SPEC_FILE).read_bytes())["trainer"]
    size, step = trainer["micro_batch_size"], trainer["global_batch_size"]
    ids = committed_rollouts(workdir)
    rows: dict[str, list[float]] = {}

    def record(name: str, fraction: float, count: int) -> None:
        rows.setdefault(name, [0.0, 0])
        rows[name][0] += fraction
        rows[name][1] += count

    steps = 0
    for rollout_id in ids:
        batch, _ = read_rollout(workdir, rollout_id)
        lengths = batch.prompt_lengths + batch.response_lengths
        for rows_of_step in torch.arange(batch.size).split(step):
            steps += 1
            fixed = fixed_micro_batches(rows_of_step, size)
            record(
                f"{size} samples, padded to the batch's width",
                padding_fraction(fixed, lengths, batch.tokens.shape[1]),
                len(fixed),
            )
            record(f"{size} samples, padded to their longest", padding_fraction(fixed, lengths), len(fixed))
            for budget in budgets:
                grouped = token_budget_micro_batches(rows_of_step, lengths, budget, packed=False)
                record(f"token budget {budget}", padding_fraction(grouped, lengths), len(grouped))
    print(f"{len(ids)} rollouts ({ids[0]}..{ids[-1]}), {steps} optimizer steps of {step} samples, from {workdir}")
    print("| micro-batches | padding (share of token slots) | micro-batches per step |")
    print("|---|---|---|")
    for name, (fraction, count) in rows.items():
        print(f"| {name} | {fraction / steps:.1%} | {count / steps:.1f} |")


if __name__ == "__main__":
    main()
