"""The cpu engine's memory handover on SmolLM2-135M-Instruct: what a release gives back, what each step costs.

    .venv/bin/python bench/engine_memory_bench.py [--rounds 5]

Colocated mode's engine side (SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation``, which the cpu engine implements for real): one
deterministic engine process, a seeded request served, then ``--rounds`` times
a release of the weights and KV cache and a resume. Reports the engine's
resident memory (RSS) served, released and resumed, against the model's size
as served (float32), the time of each release and resume (the resume reads
the weights from disk again), and whether the tokens served after each resume
equal those served before any release. Results go in docs/benchmarks/engines.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import psutil
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic_rl.engines.client import EngineClient  # noqa: E402
from elastic_rl.engines.launcher import engine_command  # noqa: E402
from elastic_rl.net import free_port, url  # noqa: E402
from elastic_rl.spec.engines import EnginesSpec  # noqa: E402
from tests.processes import SMOLLM2  # noqa: E402

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
PARAMS = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}


def served_bytes(model: Path) -> int:
    """The model's parameters in float32, as the cpu engine holds them."""
    total = 0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as weights:
            total += 4 * sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return total


async def measure(client: EngineClient, pid: int, rounds: int) -> dict:
    def rss() -> int:
        return psutil.Process(pid).memory_info().rss

    first = await client.generate(PROMPT, PARAMS)
    served = [rss()]
    released, resumed, release_s, resume_s, same = [], [], [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        await client.release_memory_occupation()
        release_s.append(time.perf_counter() - started)
        released.append(rss())
        started = time.perf_counter()
        await client.resume_memory_occupation()
        resume_s.append(time.perf_counter() - started)
        resumed.append(rss())
        again = await client.generate(PROMPT, PARAMS)
        served.append(rss())
        same.append(again["output_ids"] == first["output_ids"])
    return {
        "model_mb": served_bytes(SMOLLM2) / 2**20,
        "served_mb": median(served) / 2**20,
        "released_mb": median(released) / 2**20,
        "resumed_mb": median(resumed) / 2**20,
        "release_s": median(release_s),
        "resume_s": median(resume_s),
        "tokens_equal_after_every_resume": all(same),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    command = engine_command(EnginesSpec(kind="cpu"), SMOLLM2, port, deterministic=True, incremental_streaming=True)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = EngineClient(url(port))
        asyncio.run(client.wait_healthy(120, process))
        figures = asyncio.run(measure(client, process.pid, args.rounds))
    finally:
        process.kill()
        process.wait(timeout=10)
    print(figures)
    print(
        "| model, float32 (MB) | RSS serving (MB) | RSS released (MB) | RSS resumed (MB) | release (s) | resume (s) |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {figures['model_mb']:.0f} | {figures['served_mb']:.0f} | {figures['released_mb']:.0f} | "
        f"{figures['resumed_mb']:.0f} | {figures['release_s']:.3f} | {figures['resume_s']:.3f} |"
    )


if __name__ == "__main__":
    main()
