"""The model and engine stack end to end, as `make demo` shows it.

    python -m elastic_rl.demo examples/tiny-grpo.yaml

Builds the spec's model with megatron-core, exports it as an HF checkpoint to
``runs/<name>-demo/weights/0`` (beside the job's work dir; and a second one, from another seed, as version 1),
starts the spec's engines (two cpu engines by default) behind sglang-router,
generates a few completions through the router with their log probabilities,
then loads version 1 into every engine and generates again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from checkpoints import layout
from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.launcher import start_engine
from elastic_rl.engines.router import RouterClient, router_command
from elastic_rl.errors import ElasticRLError
from elastic_rl.model.export import export_initial_checkpoint
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.net import free_port, url
from elastic_rl.spec.job import JobSpec
from elastic_rl.spec.loading import load_spec

PROMPTS = ["copy: abc =", "copy: hello =", "copy: 2024 ="]


def export_two_versions(spec: JobSpec, workdir: Path) -> tuple[Path, Path]:
    """Version 0: the spec's initial model. Version 1: the same model from another seed.

    Version 1 stands in for trained weights: what matters here is that engines
    load new weights from disk and report the new version.
    """
    v0, v1 = layout.weights_dir(workdir, 0), layout.weights_dir(workdir, 1)
    parameters = export_initial_checkpoint(spec, v0)
    export_initial_checkpoint(spec.model_copy(update={"seed": spec.seed + 1}), v1)
    print(f"model: megatron-core GPTModel, {parameters:,} parameters")
    print(f"exported HF checkpoints: {v0} (version 0), {v1} (version 1)")
    return v0, v1


@contextlib.contextmanager
def running(processes: list[subprocess.Popen]) -> Iterator[list[subprocess.Popen]]:
    try:
        yield processes
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


async def show_generations(router: RouterClient, tokenizer, spec: JobSpec) -> None:
    params = {
        "temperature": spec.rollout.temperature,
        "max_new_tokens": spec.rollout.max_new_tokens,
        "seed": spec.seed,
    }
    results = await asyncio.gather(*(router.generate(tokenizer(prompt)["input_ids"], params) for prompt in PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        meta = result["meta_info"]
        logprobs = [round(entry[0], 3) for entry in meta["output_token_logprobs"]]
        print(f"  {prompt!r} -> {result['text']!r}")
        print(
            f"    weight_version={meta['weight_version']} finish={meta['finish_reason']['type']} "
            f"logprobs={logprobs[:6]}{' ...' if len(logprobs) > 6 else ''}"
        )


async def serve_and_generate(spec: JobSpec, v0: Path, v1: Path, workdir: Path) -> None:
    tokenizer = load_tokenizer(spec.model)
    engine_ports = [free_port() for _ in range(spec.engine_count)]
    router_port = free_port()
    layout.logs_dir(workdir).mkdir(parents=True, exist_ok=True)
    logs = [open(layout.proc_log_path(workdir, f"engine-{i}"), "wb") for i in range(len(engine_ports))]
    router_log = open(layout.proc_log_path(workdir, "router"), "wb")
    engines = [start_engine(spec.engines, v0, port, log) for port, log in zip(engine_ports, logs)]
    router_process = subprocess.Popen(
        router_command(router_port, free_port()), stdout=router_log, stderr=subprocess.STDOUT
    )
    with running([*engines, router_process]):
        for process, port in zip(engines, engine_ports):
            await EngineClient(url(port)).wait_healthy(spec.engines.startup_timeout_s, process)
        router = RouterClient(url(router_port))
        await router.wait_healthy(60, router_process)
        for port in engine_ports:
            await router.add_worker(url(port))
        print(f"router {url(router_port)} serving engines {sorted(await router.worker_urls())}")
        print("generations through the router (weights version 0):")
        await show_generations(router, tokenizer, spec)
        for port in engine_ports:
            await EngineClient(url(port)).update_weights_from_disk(str(v1), "1")
        print("generations after update_weights_from_disk (weights version 1):")
        await show_generations(router, tokenizer, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_rl.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path, help="job spec, e.g. examples/tiny-grpo.yaml")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec)
        # Its own folder beside the job's work dir: a job of the same spec writes its engine and router
        # logs under its work dir.
        jobdir = spec.resolved_workdir
        workdir = jobdir.with_name(f"{jobdir.name}-demo")
        v0, v1 = export_two_versions(spec, workdir)
        asyncio.run(serve_and_generate(spec, v0, v1, workdir))
    except ElasticRLError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
