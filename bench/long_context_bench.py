"""The trainer's model on long sequences against transformers' Llama of the same shape: time and peak memory of
one step, per sequence length, as ratios in one run.

    .venv/bin/python bench/long_context_bench.py                                  # CPU: SmolLM2-135M's shape, fp32
    .venv/bin/python bench/long_context_bench.py --shape llama-1b --device cuda \\
        --lengths 2048 4096 8192 16384 32768 65536 --dtype bf16 --recompute full  # one GPU: Llama 3.2 1B's shape

A step is the forward and backward pass of one sequence's response-half log probs (the second half of the
sequence scored, given the first): elastic-rl's as the trainer runs it (``build_gpt`` with the trainer's
defaults, fused attention, ``decoder_states`` and ``token_scores``), transformers' as a careful user would
(``LlamaForCausalLM`` with ``attn_implementation="sdpa"``, ``logits_to_keep`` for the scored half, the log
softmax in fp32). Both start from random weights of the same shape; with ``--dtype bf16`` both run bf16
autocast over fp32 parameters. Each (tool, length) runs in a process of its own: time is the median of
``--repeats`` steps after one warm-up step, the median over ``--rounds`` such processes run by turns
with the other tool's; peak memory is the growth over the weights, the process's resident peak on the CPU
(VmHWM, measured in a process of its own: see ``cases``), the CUDA allocator's peak on a GPU. A length
that does not fit prints ``out of memory``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# hidden, layers, heads, kv heads, ffn, vocabulary (tied embeddings for both).
SHAPES = {
    "smollm2": (576, 30, 9, 3, 1536, 49152),
    "llama-1b": (2048, 16, 32, 8, 8192, 128256),
}
GIB = 1024**3


def resident(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def hf_config(shape: str, length: int):
    from transformers import LlamaConfig

    hidden, layers, heads, kv_heads, ffn, vocab = SHAPES[shape]
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=length,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def transformers_step(shape: str, length: int, device, dtype):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config(shape, length)).to(device).train()
    half = length // 2

    def step(tokens):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not torch.float32):
            logits = model(tokens[:, :-1], logits_to_keep=half).logits
        logp = logits.float().log_softmax(-1).gather(-1, tokens[:, -half:, None])
        logp.sum().backward()
        model.zero_grad(set_to_none=True)

    return step


def elastic_step(shape: str, length: int, device, dtype, recompute: str):
    import torch

    from elastic_rl.architecture import Architecture
    from elastic_rl.model.gpt import ModelOptions, build_gpt, decoder_states, init_model_parallel
    from elastic_rl.model.packing import ModelInput
    from elastic_rl.model.token_scores import Entropy, token_scores
    from elastic_rl.net import free_port
    from elastic_rl.spec.trainer import Recompute
    from policies.devices import DeviceKind, Precision, ProcessDevice

    kind = DeviceKind.CUDA if device.type == "cuda" else DeviceKind.CPU
    init_model_parallel(1, seed=0, init_method=f"tcp://127.0.0.1:{free_port()}", device=ProcessDevice(kind, (0,)))
    precision = Precision.FP32 if dtype is torch.float32 else Precision.BF16
    options = ModelOptions(precision=precision, recompute=Recompute(recompute))
    hidden, layers, heads, kv_heads, ffn, vocab = SHAPES[shape]
    arch = Architecture(
        "llama",
        vocab,
        hidden,
        layers,
        heads,
        kv_heads,
        hidden // heads,
        ffn,
        length,
        10000.0,
        1e-6,
        tie_embeddings=True,
    )
    model = build_gpt(arch, 1, options).to(device).train()
    half = length // 2

    def step(tokens):
        item = ModelInput(tokens[:, :-1], tokens[:, -half:], rows=1, first=length - half)
        logp, _ = token_scores(model, decoder_states(model, item), item.targets, 1.0, Entropy.NONE)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)

    return step


def run_case(tool: str, shape: str, length: int, device_name: str, dtype_name: str, repeats: int, recompute: str):
    """One (tool, length) in this process: prints its figures as JSON."""
    import torch

    torch.manual_seed(0)
    device = torch.device(device_name)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    if device.type == "cpu":
        torch.set_num_threads(int(torch.get_num_threads()))
    make = transformers_step if tool == "transformers" else elastic_step
    step = (
        make(shape, length, device, dtype) if tool == "transformers" else make(shape, length, device, dtype, recompute)
    )
    vocab = SHAPES[shape][-1]
    tokens = torch.randint(0, vocab, (1, length + 1), generator=torch.Generator().manual_seed(1)).to(device)

    def synced():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resident("VmRSS")
    try:
        step(tokens)  # warm-up
        times = []
        for _ in range(repeats):
            synced()
            started = time.perf_counter()
            step(tokens)
            synced()
            times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError:
        print(json.dumps({"oom": True}))
        return
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else resident("VmHWM")
    print(json.dumps({"time_s": statistics.median(times), "peak_growth_bytes": peak - base}))


def cases(args, length: int) -> dict[str, dict]:
    """Both tools at ``length``: each one's time, the median over ``--rounds`` processes run by turns (one
    tool's, then the other's), and on the CPU its memory from one more process, where every allocation of
    64 KiB or more is a mapping of its own, given back when freed, so that the resident peak is the tensors'
    own rather than the heap's fragments (which would slow the timed steps)."""
    times: dict[str, list[dict]] = {"elastic": [], "transformers": []}
    for _ in range(args.rounds):
        for tool in times:
            times[tool].append(_run_case(args, tool, length, args.repeats, {}))
    found = {}
    for tool, runs in times.items():
        timed = [run for run in runs if "time_s" in run]
        if not timed:
            found[tool] = runs[0]
            continue
        figures = {**timed[0], "time_s": statistics.median(run["time_s"] for run in timed)}
        if args.device == "cpu":
            measured = _run_case(args, tool, length, 1, {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)})
            figures["peak_growth_bytes"] = measured.get("peak_growth_bytes", figures["peak_growth_bytes"])
        found[tool] = figures
    return found


def _run_case(args, tool: str, length: int, repeats: int, environment: dict[str, str]) -> dict:
    command = [
        sys.executable,
        __file__,
        "--case",
        tool,
        "--shape",
        args.shape,
        "--lengths",
        str(length),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--repeats",
        str(repeats),
        "--recompute",
        args.recompute,
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, **environment})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"oom": "out of memory" in done.stderr.lower() or "OutOfMemoryError" in done.stderr}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps in each process, after a warm-up")
    parser.add_argument("--rounds", type=int, default=3, help="timing processes of each tool, run by turns")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--case", choices=["elastic", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case is not None:
        run_case(args.case, args.shape, args.lengths[0], args.device, args.dtype, args.repeats, args.recompute)
        return
    print(
        f"shape {args.shape}, {args.dtype} on {args.device}, recompute {args.recompute}, "
        f"median of {args.repeats} steps x {args.rounds} processes"
    )
    print("| tokens | elastic-rl: time, peak growth | transformers (sdpa) | time ratio | memory ratio |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        both = cases(args, length)
        ours, theirs = both["elastic"], both["transformers"]

        def shown(figures: dict) -> str:
            if "time_s" not in figures:
                return "out of memory" if figures.get("oom") else "failed"
            return f"{figures['time_s']:.3f} s, {figures['peak_growth_bytes'] / GIB:.2f} GiB"

        both = "time_s" in ours and "time_s" in theirs
        time_ratio = f"{ours['time_s'] / theirs['time_s']:.2f}" if both else "-"
        memory_ratio = f"{ours['peak_growth_bytes'] / theirs['peak_growth_bytes']:.2f}" if both else "-"
        print(f"| {length:,} | {shown(ours)} | {shown(theirs)} | {time_ratio} | {memory_ratio} |", flush=True)


if __name__ == "__main__":
    main()
