"""What the gpu tests share: how many GPUs they need, SGLang, and one erld that offers the machine's GPUs.

Every test here is marked ``gpu`` and is skipped where CUDA is absent (tests/conftest.py); one that
needs more GPUs than the machine has, or SGLang where it is not installed, skips with that reason.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.integration.erld_support import running_daemon
from tests.processes import SMOLLM2


def require_gpus(count: int) -> None:
    found = torch.cuda.device_count()
    if found < count:
        pytest.skip(f"needs {count} GPUs (a device slot each); this machine has {found}")


def require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("needs SGLang: pip install -e '.[sglang]' on this GPU machine")


def require_smollm2() -> None:
    assert (SMOLLM2 / "config.json").is_file(), f"{SMOLLM2} is missing: run `make models`"


@pytest.fixture(scope="session")
def gpu_daemon(tmp_path_factory):
    """One erld started with `--gpus all`: its device slots are this machine's GPUs."""
    with running_daemon(tmp_path_factory.mktemp("gpu-erld"), gpus="all") as topology:
        yield topology
