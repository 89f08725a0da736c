"""Suite-wide settings: `gpu`-marked tests are skipped where CUDA is absent."""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here (docs/gpu.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
