"""Builds the command line of an engine of either kind and starts it.

``engine_command`` is pure: it turns the engines spec into the argv of
``python -m elastic_rl.engines.cpu_server`` (kind ``cpu``) or of
``python -m sglang.launch_server`` (kind ``sglang``; the spec's ``extra_args``
pass through untouched, for fp8, DeepEP, speculative decoding and the like).
An engine's GPUs are not on its command line: erld starts it seeing exactly
its slots (``CUDA_VISIBLE_DEVICES``, ``daemon.plan``), so SGLang's GPUs 0 to
tp_size - 1 are its own. ``engine_env`` is what the kind adds to the engine's
environment. ``start_engine`` runs it as a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import IO

from elastic_rl import jobenv
from elastic_rl.spec.engines import EnginesSpec


def engine_command(
    spec: EnginesSpec,
    model_path: Path,
    port: int,
    host: str = "127.0.0.1",
    weight_version: str = "0",
    deterministic: bool = False,
    incremental_streaming: bool = False,
    colocated: bool = False,
    routed_experts: bool = False,
) -> list[str]:
    """``incremental_streaming``: a cpu engine's streamed chunks hold only the new tokens (SGLang's
    --incremental-streaming-output, which older SGLang releases lack: give it in extra_args there).
    ``colocated``: the engine shares its GPU with a trainer rank and releases its memory on request,
    which SGLang does only through torch_memory_saver (--enable-memory-saver); a cpu engine always can.
    ``routed_experts``: requests may ask for their routing record (algorithm.routing_replay), which SGLang
    answers only when started with --enable-return-routed-experts; a cpu engine of a mixture of experts
    always can."""
    determinism = ["--enable-deterministic-inference"] if deterministic else []
    if spec.kind == "cpu":
        return [
            sys.executable,
            "-m",
            "elastic_rl.engines.cpu_server",
            "--model-path",
            str(model_path),
            "--host",
            host,
            "--port",
            str(port),
            "--weight-version",
            weight_version,
            # erld starts cpu engines while the job's first weights are still being exported: they import meanwhile.
            "--wait-for-model",
            str(spec.startup_timeout_s),
            *determinism,
            *(["--incremental-streaming-output"] if incremental_streaming else []),
        ]
    command = [
        sys.executable,
        "-m",
        # SGLang takes the job's secret only as --api-key: this adds it out of sight (keyed_launch).
        "elastic_rl.engines.keyed_launch",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(spec.tp_size),
        "--dtype",
        spec.dtype,
        "--mem-fraction-static",
        str(spec.mem_fraction_static),
        "--weight-version",
        weight_version,
        # erld's health check reads the engine's progress counter from /metrics (policies.engine_health).
        "--enable-metrics",
        *determinism,
        *(["--enable-memory-saver"] if colocated else []),
        *(["--enable-return-routed-experts"] if routed_experts else []),
    ]
    return command + list(spec.extra_args)


def engine_env(spec: EnginesSpec) -> dict[str, str]:
    """SGLang's /health runs a generation unless told not to, and it waits while the engine loads
    weights: the router, which polls /health, would take a healthy engine, loading, for a dead one.
    Without that generation, /health says only that the server answers; erld tells a hang from a
    load by the engine's progress counter (``policies.engine_health``)."""
    return {jobenv.SGLANG_HEALTH_GENERATION: "0"} if spec.kind == "sglang" else {}


def start_engine(
    spec: EnginesSpec,
    model_path: Path,
    port: int,
    log_file: IO[bytes] | None = None,
    host: str = "127.0.0.1",
    weight_version: str = "0",
    deterministic: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start an engine process (in ``env``, else this process's environment, plus ``engine_env``);
    wait for it with ``EngineClient.wait_healthy(spec.startup_timeout_s, process)``."""
    return subprocess.Popen(
        engine_command(spec, model_path, port, host, weight_version, deterministic),
        stdout=log_file,
        stderr=subprocess.STDOUT if log_file is not None else None,
        env={**(os.environ if env is None else env), **engine_env(spec)},
    )
