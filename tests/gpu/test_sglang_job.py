"""A job whose engine is a real SGLang server: SmolLM2-135M-Instruct, two rollouts, the trainer in bf16 on
its own GPU, the engine on another. The weights reach the engine from disk, or by NCCL broadcast."""

from __future__ import annotations

import math

import pytest

from tests.gpu.conftest import require_gpus, require_sglang, require_smollm2
from tests.integration.erld_support import job_events, metrics, run_job, status
from tests.integration.test_smollm2_job import SPEC, short_job

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(2400)]


@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_a_two_rollout_job_with_one_sglang_engine(gpu_daemon, tmp_path, weight_sync):
    require_gpus(2)
    require_sglang()
    require_smollm2()
    job = short_job() + [
        "--set",
        "rollout.num_rollouts=2",
        "--set",
        "rollout.deterministic=false",
        "--set",
        "engines.kind=sglang",
        "--set",
        "engines.count=1",
        "--set",
        "engines.mem_fraction_static=0.5",
        "--set",
        f"engines.weight_sync={weight_sync}",
        "--set",
        "trainer.dtype=bf16",
        # Bounds a sample for `erl submit`'s memory check against the GPU: else the model's whole 8k context.
        "--set",
        "rollout.max_prompt_len=128",
    ]
    run_job(gpu_daemon, tmp_path, job, spec=SPEC, timeout_s=2000)
    lines = metrics(tmp_path)
    assert [line["rollout"] for line in lines] == [0, 1]
    for line in lines:
        # bf16 on both sides: close, not equal. A wrong weight layout would be off by whole nats.
        gap = line["train/logprob_abs_diff_max"]
        assert math.isfinite(gap) and gap < 1.0, line
    procs = status(gpu_daemon, "smollm2-math")["procs"]
    assert procs["engine-0"]["device"] != procs["trainer-0-0"]["device"]
    events = job_events(tmp_path)
    assert not [e for e in events if e["kind"] == "weight_broadcast_failed"], events
    if weight_sync == "distributed":
        assert all(line["train/broadcast_engines"] == 1.0 for line in lines), lines


@pytest.mark.parametrize("weight_sync", ["disk", "memory"])
def test_a_colocated_sglang_engine_shares_the_trainers_gpu(gpu_daemon, tmp_path, weight_sync):
    """One GPU: the bf16 trainer and the SGLang engine take turns on it, the engine releasing its memory
    (torch_memory_saver) while the trainer trains and the trainer offloading while the engine generates."""
    require_gpus(1)
    require_sglang()
    require_smollm2()
    job = short_job() + [
        *("--set", "rollout.num_rollouts=3", "--set", "rollout.deterministic=false"),
        *("--set", "placement=colocated", "--set", "engines.count=null", "--set", "engines.kind=sglang"),
        *("--set", "engines.mem_fraction_static=0.3", "--set", f"engines.weight_sync={weight_sync}"),
        *("--set", "trainer.dtype=bf16", "--set", "rollout.max_prompt_len=128"),
    ]
    run_job(gpu_daemon, tmp_path, job, spec=SPEC, timeout_s=2000)
    lines = metrics(tmp_path)
    assert [line["rollout"] for line in lines] == [0, 1, 2]
    procs = status(gpu_daemon, "smollm2-math")["procs"]
    assert procs["engine-0"]["device"] == procs["trainer-0-0"]["device"]
    slot = f"{procs['trainer-0-0']['node']}/{procs['trainer-0-0']['device']}"
    for line in lines:
        assert math.isfinite(line["train/logprob_abs_diff_max"]) and line["train/logprob_abs_diff_max"] < 1.0, line
        assert line["handover/release_time"] >= 0 and line[f"memory/{slot}/training_peak_bytes"] > 0, line
    if weight_sync == "memory":
        assert [line.get("rollout/weights_from_memory") for line in lines[1:]] == [1.0, 1.0], lines
