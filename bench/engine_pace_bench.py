"""A rollout's generation time with one engine at a quarter of its speed, with and without pacing.

    .venv/bin/python bench/engine_pace_bench.py [--requests 64] [--new-tokens 48] [--rollouts 2] [--max-batch-size 64]

Two cpu engines serving SmolLM2-135M-Instruct (one torch thread each) behind
the real sglang-router, reached as the orchestrator reaches them
(``EngineAccess``, with the ``PaceMeter`` measuring while it generates). A
rollout is ``--requests`` streamed requests sent at once, each forced to
``--new-tokens`` tokens; an engine runs at most ``--max-batch-size`` at once
and queues the rest. Three cases in one run:

- every engine at full speed;
- one engine SIGSTOPped 0.15 s of every 0.2 s (a quarter of its speed), no
  pacing (``engines.straggler_factor: null``: the router's even share);
- the same slow engine, with pacing (the default factor 2): the first rollout
  is sent evenly while the meter measures, the ones after it by pace.

Reports each case's mean generation time per rollout (after the first, for the
paced case) and the ratio to full speed, and each engine's share of the
requests. Results go in docs/benchmarks/fault-tolerance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic_rl.alongside import alongside  # noqa: E402
from elastic_rl.engines.access import EngineAccess  # noqa: E402
from elastic_rl.engines.client import EngineClient  # noqa: E402
from elastic_rl.engines.pace import PaceMeter  # noqa: E402
from elastic_rl.engines.router import RouterClient, router_command  # noqa: E402
from elastic_rl.engines.streaming import Received  # noqa: E402
from elastic_rl.net import free_port, url  # noqa: E402
from policies.engine_pace import PaceVerdict  # noqa: E402
from tests.processes import SMOLLM2  # noqa: E402

STOPPED_S, PERIOD_S = 0.15, 0.2


def slow_down(pid: int, until: threading.Event) -> threading.Thread:
    def cycle() -> None:
        while not until.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STOPPED_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(PERIOD_S - STOPPED_S)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    return thread


async def finished(engine_url: str) -> int:
    load = await EngineClient(engine_url).load()
    return load.progress - load.generated_tokens


async def rollouts(
    router_url: str, engine_urls: list[str], factor: float | None, args: argparse.Namespace
) -> tuple[list[float], dict[str, int]]:
    """Each rollout's generation time, and each engine's requests over the rollouts after the first."""
    params = {"max_new_tokens": args.new_tokens, "ignore_eos": True, "temperature": 1.0}
    async with RouterClient(router_url) as router:
        meter = None if factor is None else PaceMeter(factor)
        access = EngineAccess(router, None, meter)

        async def changed(before: PaceVerdict, after: PaceVerdict) -> None:
            print(f"    pace verdict: shares {after.shares}, ratios {after.ratios}", flush=True)

        async def generate() -> None:
            prompts = [[1, 5, 9, 10 + i % 50] for i in range(args.requests)]
            await asyncio.gather(
                *(access.generate_stream(p, {**params, "sampling_seed": i}, Received()) for i, p in enumerate(prompts))
            )

        times, served = [], dict.fromkeys(engine_urls, 0)
        for index in range(args.rollouts + 1):
            before = {u: await finished(u) for u in engine_urls}
            started = time.monotonic()
            if meter is None:
                await generate()
            else:
                load = lambda engine, timeout_s: router.client_for(engine).load(timeout_s)  # noqa: E731
                async with alongside(meter.run(access.worker_urls, load, changed)):
                    await generate()
            times.append(time.monotonic() - started)
            if index:
                for u in engine_urls:
                    served[u] += await finished(u) - before[u]
        return times, served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rollouts", type=int, default=2, help="measured rollouts per case, after a first one")
    parser.add_argument("--max-batch-size", type=int, default=64, help="requests an engine runs at once")
    args = parser.parse_args()
    ports = [free_port(), free_port()]
    engines = [
        subprocess.Popen(
            [sys.executable, "-m", "elastic_rl.engines.cpu_server", "--model-path", str(SMOLLM2)]
            + ["--port", str(port), "--threads", "1", "--max-batch-size", str(args.max_batch_size)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=REPO,
        )
        for port in ports
    ]
    router_port = free_port()
    router = subprocess.Popen(
        router_command(router_port, free_port()), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    engine_urls = [url(port) for port in ports]
    try:

        async def register() -> None:
            for engine_url, process in zip(engine_urls, engines):
                await EngineClient(engine_url).wait_healthy(120, process)
            client = RouterClient(url(router_port))
            await client.wait_healthy(60, router)
            for engine_url in engine_urls:
                await client.add_worker(engine_url)

        asyncio.run(register())
        print(
            f"SmolLM2-135M-Instruct on 2 cpu engines (1 torch thread each) behind sglang-router; a rollout is "
            f"{args.requests} requests x {args.new_tokens} tokens, at most {args.max_batch_size} running per engine; "
            f"mean of {args.rollouts} rollouts after a first"
        )
        results = {}
        for case, slow, factor in (
            ("full speed", False, 2.0),
            ("one engine at 1/4 speed, no pacing", True, None),
            ("one engine at 1/4 speed, paced", True, 2.0),
        ):
            stop = threading.Event()
            thread = slow_down(engines[1].pid, stop) if slow else None
            try:
                times, served = asyncio.run(rollouts(url(router_port), engine_urls, factor, args))
            finally:
                stop.set()
                if thread is not None:
                    thread.join()
                os.kill(engines[1].pid, signal.SIGCONT)
            results[case] = sum(times[1:]) / len(times[1:])
            full = results["full speed"]
            shares = " / ".join(str(served[u]) for u in engine_urls)
            print(
                f"{case + ':':<38} {results[case]:6.1f} s per rollout  {results[case] / full:.2f}x full speed  "
                f"(first rollout {times[0]:.1f} s; requests fast / slow engine: {shares})",
                flush=True,
            )
    finally:
        for process in engines:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        router.kill()


if __name__ == "__main__":
    main()
