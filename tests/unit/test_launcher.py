"""The command lines the launcher builds for each engine kind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from elastic_rl import jobenv
from elastic_rl.engines.keyed_launch import keyed_argv
from elastic_rl.engines.launcher import engine_command, engine_env
from elastic_rl.spec.engines import EnginesSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_cpu_engine_command():
    command = engine_command(EnginesSpec(kind="cpu"), Path("/w/0"), 30001, weight_version="4")
    assert command[:3] == [sys.executable, "-m", "elastic_rl.engines.cpu_server"]
    assert command[command.index("--port") + 1] == "30001"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--weight-version") + 1] == "4"


def test_sglang_command_passes_extra_args_through():
    # model_construct: this machine has no SGLang, which validation would refuse.
    spec = EnginesSpec.model_construct(
        kind="sglang",
        tp_size=2,
        dtype="bfloat16",
        mem_fraction_static=0.7,
        extra_args=["--quantization", "fp8", "--speculative-algorithm", "EAGLE"],
    )
    command = engine_command(spec, Path("/w/0"), 30002, deterministic=True)
    assert command[:4] == [sys.executable, "-m", "elastic_rl.engines.keyed_launch", "sglang.launch_server"]
    assert command[command.index("--tp-size") + 1] == "2"
    assert command[command.index("--mem-fraction-static") + 1] == "0.7"
    assert command[command.index("--dtype") + 1] == "bfloat16"  # not SGLang's float16 for a float32 checkpoint
    assert "--base-gpu-id" not in command  # its GPUs come from CUDA_VISIBLE_DEVICES
    assert "--enable-deterministic-inference" in command
    assert "--enable-metrics" in command  # erld's health check reads its progress counter
    assert command[-4:] == ["--quantization", "fp8", "--speculative-algorithm", "EAGLE"]
    assert "--enable-memory-saver" not in command
    # Colocated, SGLang releases its memory between turns only through torch_memory_saver.
    assert "--enable-memory-saver" in engine_command(spec, Path("/w/0"), 30002, colocated=True)
    # Routing replay: SGLang answers a request's return_routed_experts only when started for it.
    assert "--enable-return-routed-experts" not in command
    assert "--enable-return-routed-experts" in engine_command(spec, Path("/w/0"), 30002, routed_experts=True)


def test_an_sglang_engine_health_is_liveness_only():
    # SGLang's /health would otherwise run a generation, which waits while the engine loads weights,
    # and the router, which polls it, would take a loading engine for a dead one.
    assert engine_env(EnginesSpec.model_construct(kind="sglang")) == {jobenv.SGLANG_HEALTH_GENERATION: "0"}
    assert engine_env(EnginesSpec(kind="cpu")) == {}


def test_the_router_takes_the_jobs_secret_as_its_keys_whatever_its_first_character():
    # sglang-router's own parser; a secret made before token_hex could start with "-".
    from sglang_router.launch_router import parse_router_args

    for secret in ("-starts-with-a-dash", "0123abcd"):
        module, *args = keyed_argv("sglang_router.launch_router", ["--port", "30000"], secret)
        parsed = parse_router_args(args)
        assert module == "sglang_router.launch_router"
        assert parsed.api_key == secret
        assert parsed.control_plane_api_keys == [("erld", "elastic-rl", secret, "admin")]
    assert keyed_argv("sglang.launch_server", ["--port", "1"], None) == ["sglang.launch_server", "--port", "1"]
