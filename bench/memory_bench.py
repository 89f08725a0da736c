"""Benchmark: memory per trainer rank, from the accounting (`erl plan`) and as measured.

    .venv/bin/python bench/memory_bench.py [--no-measure]

First the accounting alone, for three Llama-architecture models (Llama 3.2 1B, Llama 3 8B, and LLaMA's
33B shape, 32.5B parameters) at several replica layouts: the bytes one rank holds for parameters,
gradients and optimizer state, in fp32 with AdamW whole on every rank and in bf16-params (megatron's bf16
parameters and distributed optimizer, GPU slots only), and one 4096-token micro-batch's
activation estimate. Then one sequence of 8k to 64k tokens of the 1B shape on one device, the whole rank
by each ``trainer.recompute`` (and megatron's unfused attention for comparison): what fits in how much
memory. Then, unless ``--no-measure``, the accounting against a measured step (the
test's worker, `tests/integration/memory_worker.py`, one process each): the tiny model, a wider toy
model and SmolLM2-135M on this machine's CPU, the growth of peak resident memory over the accounted
total.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from elastic_rl.net import LOOPBACK, free_port  # noqa: E402
from policies.memory import (  # noqa: E402
    FP32_WHOLE,
    GIB,
    LOGITS_BUDGET_BYTES,
    MEGATRON_BF16,
    ActivationLayout,
    Kept,
    Layout,
    ModelShape,
    rank_memory,
)
from tests.integration.memory_worker import SMOLLM2_STEP, WIDER_TOY  # noqa: E402

MODELS = {
    "Llama 3.2 1B": ModelShape(128256, 2048, 16, 32, 8, 64, 8192, tie_embeddings=True),
    "Llama 3 8B": ModelShape(128256, 4096, 32, 32, 8, 128, 14336),
    "LLaMA 33B shape": ModelShape(32000, 6656, 60, 52, 52, 128, 17920),
}
LAYOUTS = [Layout(1, 1, 1), Layout(8, 1, 1), Layout(4, 2, 1), Layout(2, 4, 1), Layout(8, 1, 4), Layout(4, 2, 8)]
TOKENS = 4096

MEASURED = {
    "tiny (default micro-batch: 64 x 64 tokens)": ("examples/tiny-grpo.yaml", []),
    "wider toy (16 x 512 tokens)": ("examples/tiny-grpo.yaml", WIDER_TOY),
    "SmolLM2-135M (4 x 256 tokens)": ("examples/smollm2-math.yaml", SMOLLM2_STEP),
}


def accounting_table() -> None:
    print(f"| model | parameters | layout (TP x PP x DP) | fp32, whole AdamW | bf16-params, distributed optimizer | "
          f"activations, {TOKENS} tokens (fp32) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, shape in MODELS.items():
        total = rank_memory(shape, Layout(), FP32_WHOLE, 1, 1, False).parameters
        for layout in LAYOUTS:
            ours = rank_memory(shape, layout, FP32_WHOLE, TOKENS, TOKENS, False)
            megatron = rank_memory(shape, layout, MEGATRON_BF16, TOKENS, TOKENS, False)

            def state(memory) -> float:
                return (memory.parameter_bytes + memory.gradient_bytes + memory.optimizer_bytes) / GIB

            print(
                f"| {name} | {total / 1e9:.2f} B | {layout.tensor_parallel} x {layout.pipeline_parallel} x "
                f"{layout.data_parallel} | {state(ours):.1f} GiB | {state(megatron):.1f} GiB | "
                f"{ours.activation_bytes / GIB:.1f} GiB |"
            )


LONG = [8192, 16384, 32768, 65536]


def long_sequence_table() -> None:
    shape = MODELS["Llama 3.2 1B"]
    ways = {
        f"sdpa, recompute {kept.value}": ActivationLayout(kept=kept, logits_cap_bytes=LOGITS_BUDGET_BYTES)
        for kept in Kept
    }
    ways["local (unfused) attention, recompute none"] = ActivationLayout(fused_attention=False)
    print("| Llama 3.2 1B, one sequence, fp32 AdamW, one device | " + " | ".join(f"{n:,} tokens" for n in LONG) + " |")
    print("|---|" + "---|" * len(LONG))
    for name, held in ways.items():
        totals = [rank_memory(shape, Layout(), FP32_WHOLE, n, n, False, held).total / GIB for n in LONG]
        print(f"| {name} | " + " | ".join(f"{total:.1f} GiB" for total in totals) + " |")


def measure(spec: str, overrides: list[str], out: Path) -> dict:
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-W", "ignore", "-m", "tests.integration.memory_worker", str(out), spec, *overrides]
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
    return orjson.loads(out.with_suffix(".0.json").read_bytes())


def measured_table(scratch: Path) -> None:
    print("| model | state accounted = held | peak growth measured | accounted total | measured / accounted |")
    print("|---|---|---|---|---|")
    for index, (name, (spec, overrides)) in enumerate(MEASURED.items()):
        result = measure(spec, overrides, scratch / f"m{index}")
        exact = result["state_bytes"] == result["accounted_state_bytes"]
        print(
            f"| {name} | {'yes' if exact else 'NO'} ({result['state_bytes'] / 2**20:.1f} MiB) | "
            f"{result['peak_growth_bytes'] / 2**20:.0f} MiB | {result['accounted_total_bytes'] / 2**20:.0f} MiB | "
            f"{result['peak_growth_bytes'] / result['accounted_total_bytes']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-measure", action="store_true", help="the accounting table alone")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/memory-bench"))
    args = parser.parse_args()
    accounting_table()
    print()
    long_sequence_table()
    if not args.no_measure:
        args.scratch.mkdir(parents=True, exist_ok=True)
        print()
        measured_table(args.scratch)


if __name__ == "__main__":
    main()
