"""The memory accounting on a GPU: the state counted to the byte and the CUDA peak of a step bounded by the
estimate, in fp32, bf16 and bf16-params; erld's node record carrying the GPU's memory, and `erl submit` refusing a job
whose trainer rank cannot fit it."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from chaos.erl_cli import erl
from elastic_rl.store.client import Store
from elastic_rl.store.devices import live_nodes
from tests.gpu.conftest import require_gpus
from tests.integration.erld_support import running_daemon
from tests.integration.memory_worker import WIDER_TOY
from tests.processes import SPEC, run_module_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "settings",
    [
        ["trainer.dtype=fp32"],
        ["trainer.dtype=bf16"],
        ["trainer.dtype=bf16-params"],
        ["trainer.dtype=fp32", "trainer.optimizer_offload=true"],
        ["trainer.dtype=bf16", "trainer.optimizer_offload=true"],
    ],
)
def test_the_state_is_counted_and_the_estimate_bounds_a_gpu_step(tmp_path, settings):
    require_gpus(1)
    out = tmp_path / "memory"
    run_module_ranks("tests.integration.memory_worker", 1, out, SPEC, *WIDER_TOY, *settings, gpus=True)
    result = orjson.loads(out.with_suffix(".0.json").read_bytes())
    print(settings, result)  # the measured ratio, for docs/gpu.md
    assert result["parameters"] == result["accounted_parameters"]
    assert result["state_bytes"] == result["accounted_state_bytes"]
    assert 0 < result["peak_growth_bytes"] <= result["accounted_total_bytes"], result
    # Offloaded, the moments are in host memory, within what the plan counts there (with the copy buffers).
    offloaded = "trainer.optimizer_offload=true" in settings
    assert (
        (0 < result["host_state_bytes"] <= result["accounted_host_bytes"])
        if offloaded
        else (result["host_state_bytes"] == result["accounted_host_bytes"] == 0)
    ), result


def test_a_gpu_node_reports_its_memory_and_submit_refuses_what_cannot_fit(tmp_path):
    require_gpus(1)

    async def nodes(endpoint: str) -> dict:
        async with Store(endpoint) as store:
            return await live_nodes(store)

    with running_daemon(tmp_path, gpus="all") as daemon:
        (record,) = asyncio.run(nodes(daemon.endpoint)).values()
        assert record["kind"] == "cuda" and record["slot_memory"] > 8 * 1024**3, record
        # A 64k context in micro-batches of 64 samples: terabytes of activations.
        refused = erl(
            "submit", str(SPEC), "--workdir", str(tmp_path / "job"), "--etcd", daemon.endpoint,
            "--set", "trainer.dtype=bf16", "--set", "model.max_position_embeddings=65536",
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert "trainer.tensor_parallel" in refused.stderr
