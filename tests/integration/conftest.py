"""Fixtures for integration tests: exported checkpoints of the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.erld_support import daemon  # noqa: F401 (a fixture for the erld tests)
from tests.processes import export_checkpoint

# Long enough for generations that are still running when a test acts on them.
LONG_CONTEXT = "model.max_position_embeddings=32768"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two HF checkpoints of the same architecture: versions 0 and 1.

    A freshly initialised model is close to uniform, so version 1 is drawn with a
    larger initial scale: its samples differ visibly from version 0's.
    """
    root = tmp_path_factory.mktemp("weights")
    v0 = export_checkpoint(root / "0", LONG_CONTEXT, "seed=1234")
    v1 = export_checkpoint(root / "1", LONG_CONTEXT, "seed=4321", "model.init_method_std=0.5")
    return v0, v1
