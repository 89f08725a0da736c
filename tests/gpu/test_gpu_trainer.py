"""The trainer on a GPU, with one: a node offering its GPU (`erl daemon --gpus all`) and a CPU node beside it
in the same etcd. The tiny job's replica trains in bf16, megatron's autocast or its bf16 parameters (so it
may go only to the GPU), its cpu engines run on the CPU node. The reward rises, and a trainer killed mid-run
restarts on the GPU from its snapshot. Each job is bounded well inside the gpu suite's ten minutes.

The other gpu tests need SGLang or two and three GPUs; this one needs what any GPU machine has."""

from __future__ import annotations

import math
from statistics import mean

import pytest

from chaos.topology import ErldNode, Topology
from tests.gpu.conftest import require_gpus
from tests.integration.erld_support import NO_POOL, job_events, metrics, run_job, status

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

JOB = ["--set", "checkpoints.interval_rollouts=2"]
LEARNS, RESTARTS = 30, 10
"""Rollouts of the job that learns, and of the jobs whose trainer is killed at rollout 4."""


@pytest.fixture
def gpu_and_cpu_nodes(tmp_path):
    """gpu-node offers the machine's GPUs (and runs the etcd); cpu-node offers 2 CPU slots."""
    require_gpus(1)
    # erld's default pool on the GPU node: a restarted trainer is a pre-imported interpreter, as in production.
    gpu = Topology.single(tmp_path / "nodes", name="gpu-node", gpus="all")
    with gpu:
        cpu = ErldNode("cpu-node", tmp_path / "nodes" / "cpu-node", 2, gpu.endpoint, pool=NO_POOL)
        cpu.start()
        try:
            cpu.wait_ready()
            yield gpu
        finally:
            cpu.stop()


def run(nodes: Topology, workdir, dtype: str, rollouts: int, faults: list) -> list[dict]:
    job = [*JOB, "--set", f"trainer.dtype={dtype}", "--set", f"rollout.num_rollouts={rollouts}"]
    run_job(nodes, workdir, job, faults, timeout_s=240)
    procs = status(nodes, "tiny-grpo")["procs"]
    assert procs["trainer-0-0"]["node"] == "gpu-node", procs
    assert {procs[name]["node"] for name in ("engine-0", "engine-1")} == {"cpu-node"}, procs
    lines = metrics(workdir)
    assert [line["rollout"] for line in lines] == list(range(rollouts))
    # The engines sample in fp32 on the CPU, the trainer recomputes in bf16: close, not equal.
    assert all(math.isfinite(line["train/logprob_abs_diff_max"]) for line in lines), lines
    assert lines[0]["train/logprob_abs_diff_max"] < 0.5, lines[0]
    return lines


def test_a_bf16_trainer_on_the_gpu_learns(gpu_and_cpu_nodes, tmp_path):
    lines = run(gpu_and_cpu_nodes, tmp_path / "job", "bf16", LEARNS, [])
    rewards = [line["rollout/reward_mean"] for line in lines]
    assert mean(rewards[-5:]) >= mean(rewards[:5]) + 0.3, rewards


@pytest.mark.parametrize("dtype", ["bf16", "bf16-params"])
def test_a_gpu_trainer_killed_restarts_on_the_gpu_from_its_snapshot(gpu_and_cpu_nodes, tmp_path, dtype):
    workdir = tmp_path / "job"
    run(gpu_and_cpu_nodes, workdir, dtype, RESTARTS, [("trainer-0-0", 4)])
    events = job_events(workdir)
    restarts = [e for e in events if e["kind"] == "proc_restarted" and e["proc"] == "trainer-0-0"]
    assert restarts and all(e["node"] == "gpu-node" for e in restarts), restarts
    # It came back from a snapshot (every 2 rollouts), not from the start.
    resumed = [e for e in events if e["kind"] == "trainer_resumed" and e["proc"] == "trainer-0-0"]
    assert resumed and resumed[-1]["step"] > 0, resumed
