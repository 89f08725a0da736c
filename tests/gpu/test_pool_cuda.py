"""A pre-imported interpreter (daemon.pool) touches no GPU: its imports leave CUDA uninitialised, so
the process it becomes sees the GPU it is given and computes on it. Started and assigned exactly as erld
does: imports under the pool's environment (no GPU seen), then a GPU slot's."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from daemon.gpus import node_gpus
from daemon.plan import device_env, node_environment
from daemon.pool import MODULES
from policies.devices import DeviceKind, ProcessDevice
from tests.processes import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_a_pooled_interpreter_leaves_cuda_uninitialised(kind, tmp_path):
    log = tmp_path / "probe.log"
    # Started as erld starts its pool: seeing no GPU until its assignment names one.
    interpreter = subprocess.Popen(
        [sys.executable, "-m", "elastic_rl.warm_interpreter", MODULES[kind]],
        stdin=subprocess.PIPE,
        cwd=REPO,
        env=node_environment(),
    )
    # Assigned slot 0 of a GPU node, as erld assigns a trainer rank.
    env = {"PATH": "/usr/bin:/bin", **device_env(ProcessDevice(DeviceKind.CUDA, (0,)), node_gpus("all").cuda_indices)}
    assignment = {"argv": ["tests.gpu.cuda_probe"], "env": env, "cwd": str(REPO), "log": str(log)}
    interpreter.communicate(orjson.dumps(assignment) + b"\n", timeout=240)
    assert interpreter.returncode == 0, log.read_text()
    seen = log.read_text()
    assert "cuda initialised: False" in seen, seen
    assert "available: True" in seen, seen
    assert "devices: 1" in seen, seen
    assert "on the GPU: True" in seen, seen
