"""A pre-imported interpreter (daemon.pool) touches no GPU: its imports leave CUDA uninitialised, so
the process it becomes sees the GPU it is given."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from daemon.plan import node_environment
from daemon.pool import MODULES
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
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "0"}
    assignment = {"argv": ["tests.gpu.cuda_probe"], "env": env, "cwd": str(REPO), "log": str(log)}
    interpreter.communicate(orjson.dumps(assignment) + b"\n", timeout=240)
    assert interpreter.returncode == 0, log.read_text()
    assert "cuda initialised: False" in log.read_text()
    assert "devices: 1" in log.read_text()
