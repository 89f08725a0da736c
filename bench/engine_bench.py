"""The cpu engine against transformers' own `generate` on SmolLM2-135M-Instruct.

    .venv/bin/python bench/engine_bench.py [--threads 1] [--prompts 32] [--new-tokens 64]

The same prompts (arithmetic word problems through the chat template) and the
same sampling (temperature 1, every response forced to the full length) for:
`generate` with a batch of every prompt (left-padded, its own KV cache); the
cpu engine serving them as concurrent requests (continuous batching); and the
cpu engine in deterministic mode (each sequence its own forward passes). Each
runs with the same number of torch threads. Reports tokens/s, the ratios, and
the peak RSS of each engine process (VmHWM). Results go in docs/benchmarks/engines.md.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic_rl.engines.client import EngineClient  # noqa: E402
from elastic_rl.net import free_port, url  # noqa: E402
from elastic_rl.rollout.prompts import render  # noqa: E402
from elastic_rl.rollout.tasks import arithmetic  # noqa: E402
from elastic_rl.spec.data import DataSpec  # noqa: E402
from tests.processes import SMOLLM2  # noqa: E402


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    data = DataSpec(task="arithmetic", apply_chat_template=True)
    return [render(tokenizer, data, text) for text, _ in arithmetic(count, seed=0)]


def hf_generate(prompts: list[list[int]], new_tokens: int, threads: int) -> float:
    """Tokens/s of transformers' generate over the whole batch."""
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2), dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    started = time.monotonic()
    with torch.inference_mode():
        out = model.generate(
            input_ids=tokens,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    elapsed = time.monotonic() - started
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / elapsed


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def engine_run(
    prompts: list[list[int]], new_tokens: int, threads: int, deterministic: bool
) -> tuple[float, float]:
    """(tokens/s, peak RSS in MiB) of one cpu engine serving every prompt concurrently."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "elastic_rl.engines.cpu_server",
        "--model-path",
        str(SMOLLM2),
        "--port",
        str(port),
        "--threads",
        str(threads),
    ] + (["--enable-deterministic-inference"] if deterministic else [])
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        client = EngineClient(url(port))
        await client.wait_healthy(120, process)
        params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
        await client.generate(prompts[0], {**params, "max_new_tokens": 2})  # warm up
        started = time.monotonic()
        results = await asyncio.gather(
            *(client.generate(p, {**params, "sampling_seed": i}) for i, p in enumerate(prompts))
        )
        elapsed = time.monotonic() - started
        assert all(len(r["output_ids"]) == new_tokens for r in results)
        return len(prompts) * new_tokens / elapsed, peak_rss_mib(process.pid)
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2))
    prompts = prompt_ids(tokenizer, args.prompts)
    print(
        f"SmolLM2-135M-Instruct, {args.prompts} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens) x {args.new_tokens} new tokens, sampling at temperature 1, {args.threads} torch thread(s)"
    )
    hf = hf_generate(prompts, args.new_tokens, args.threads)
    print(f"transformers generate:            {hf:7.1f} tokens/s")
    for deterministic in (False, True):
        rate, rss = asyncio.run(engine_run(prompts, args.new_tokens, args.threads, deterministic))
        name = "cpu engine, deterministic" if deterministic else "cpu engine, continuous batching"
        print(f"{name + ':':<34}{rate:7.1f} tokens/s   {rate / hf:.2f}x generate   peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main()
