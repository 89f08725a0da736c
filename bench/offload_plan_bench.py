"""Benchmark: what ``trainer.optimizer_offload`` moves off the device, from the accounting (`erl plan`).

    .venv/bin/python bench/offload_plan_bench.py

First the bytes one rank of the Llama 3.2 1B shape holds on its device and in host memory, with and
without offload, at one and eight data-parallel ranks (AdamW sharded over them). Then, for Llama 3 8B
and a 32B dense shape (Qwen2.5-32B's), the smallest replica layout whose ranks fit an 80 GB GPU (NVML's
81,559 MiB of an H100 80GB): fp32 or bf16 AdamW without and with offload, and bf16-params. A 4,096-token
packed micro-batch, torch's fused attention, full recomputation, the logits in chunks.
Pure arithmetic: no device is touched, so the figures are the same on any machine.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from policies.memory import (  # noqa: E402
    FP32_SHARDED,
    FP32_WHOLE,
    GIB,
    LOGITS_BUDGET_BYTES,
    MEGATRON_BF16,
    MIB,
    ActivationLayout,
    Kept,
    Layout,
    ModelShape,
    Precision,
    RankMemory,
    rank_memory,
)

LLAMA_1B = ModelShape(128256, 2048, 16, 32, 8, 64, 8192, tie_embeddings=True)
LARGE = {
    "Llama 3 8B": ModelShape(128256, 4096, 32, 32, 8, 128, 14336),
    "32B dense (Qwen2.5-32B's shape)": ModelShape(152064, 5120, 64, 40, 8, 128, 27648, qkv_bias=True),
}
TOKENS = 4096
HELD = ActivationLayout(kept=Kept.INPUTS, logits_cap_bytes=LOGITS_BUDGET_BYTES)
H100_80GB = 81559 * MIB
SIZES = (1, 2, 4, 8)


def memory(shape: ModelShape, layout: Layout, precision: Precision, *, offload: bool) -> RankMemory:
    return rank_memory(shape, layout, precision, TOKENS, TOKENS, 0, HELD, optimizer_offload=offload)


def one_billion_table() -> None:
    print("| Llama 3.2 1B, one rank | device | host |")
    print("|---|---|---|")
    for data_parallel in (1, 8):
        precision = FP32_SHARDED if data_parallel > 1 else FP32_WHOLE
        for offload in (False, True):
            held = memory(LLAMA_1B, Layout(data_parallel=data_parallel), precision, offload=offload)
            state = held.parameter_bytes + held.gradient_bytes + held.optimizer_bytes
            print(
                f"| DP={data_parallel}, AdamW {'offloaded' if offload else 'on the device'} | "
                f"{state / GIB:.1f} GiB state + {held.activation_bytes / GIB:.1f} GiB activations = "
                f"{held.total / GIB:.1f} GiB | {held.host_bytes / GIB:.1f} GiB |"
            )


def smallest_fit(shape: ModelShape, precision_of, *, offload: bool) -> tuple[Layout, RankMemory] | None:
    """The layout of fewest ranks (then least device memory) whose fullest rank fits an 80 GB GPU."""
    fits = []
    for tp, pp, dp in itertools.product(SIZES, SIZES, SIZES):
        layout = Layout(tp, pp, dp)
        if shape.num_attention_heads % tp or shape.num_query_groups % tp or shape.num_layers % pp:
            continue
        held = memory(shape, layout, precision_of(dp), offload=offload)
        if held.total <= H100_80GB:
            fits.append((layout.ranks, held.total, layout, held))
    if not fits:
        return None
    _, _, layout, held = min(fits, key=lambda fit: fit[:2])
    return layout, held


def large_models_table() -> None:
    ways = {
        "fp32/bf16 AdamW": (lambda dp: FP32_SHARDED if dp > 1 else FP32_WHOLE, False),
        "fp32/bf16 AdamW, offloaded": (lambda dp: FP32_SHARDED if dp > 1 else FP32_WHOLE, True),
        "bf16-params": (lambda dp: MEGATRON_BF16, False),
    }
    print(
        "| model | trainer | smallest layout on 80 GB GPUs (TP x PP x DP) | ranks | device per rank | host per rank |"
    )
    print("|---|---|---|---|---|---|")
    for name, shape in LARGE.items():
        for way, (precision_of, offload) in ways.items():
            found = smallest_fit(shape, precision_of, offload=offload)
            if found is None:
                print(f"| {name} | {way} | none up to 8 x 8 x 8 | | | |")
                continue
            layout, held = found
            print(
                f"| {name} | {way} | {layout.tensor_parallel} x {layout.pipeline_parallel} x "
                f"{layout.data_parallel} | {layout.ranks} | {held.total / GIB:.1f} GiB | "
                f"{held.host_bytes / GIB:.1f} GiB |"
            )


def main() -> None:
    one_billion_table()
    print()
    large_models_table()


if __name__ == "__main__":
    main()
