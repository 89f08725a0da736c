"""The engine contract tests (tests/integration/test_engine_contract.py), unchanged, against a real SGLang
server that the launcher starts on one GPU, as erld would: SmolLM2-135M-Instruct, deterministic inference."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from daemon.gpus import node_gpus
from daemon.plan import device_env
from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.launcher import start_engine
from elastic_rl.net import free_port, url
from elastic_rl.spec.engines import EnginesSpec
from policies.devices import DeviceKind, ProcessDevice
from tests.gpu.conftest import require_gpus, require_sglang, require_smollm2
from tests.processes import REPO, SMOLLM2

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(2400)]


def test_the_engine_contract_holds_for_sglang(tmp_path):
    require_gpus(1)
    require_sglang()
    require_smollm2()
    spec = EnginesSpec(kind="sglang", mem_fraction_static=0.5)
    port = free_port()
    env = {**os.environ, **device_env(ProcessDevice(DeviceKind.CUDA, (0,)), node_gpus("all").cuda_indices)}
    with open(tmp_path / "sglang.log", "wb") as log:
        server = start_engine(spec, SMOLLM2, port, log, weight_version="0", deterministic=True, env=env)
        try:
            asyncio.run(EngineClient(url(port)).wait_healthy(spec.startup_timeout_s, server))
            contract = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "tests/integration/test_engine_contract.py",
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=1200,
                env={
                    **os.environ,
                    "ERL_ENGINE_URL": url(port),
                    "ERL_ENGINE_MODEL_PATH": str(SMOLLM2),
                    "ERL_ENGINE_DETERMINISTIC": "1",
                },
            )
        finally:
            server.kill()
            server.wait(timeout=60)
    assert contract.returncode == 0, contract.stdout[-6000:] + contract.stderr[-3000:]
    assert " passed" in contract.stdout and " skipped" not in contract.stdout, contract.stdout[-2000:]
