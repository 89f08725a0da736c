"""The CPU RNG tracker that stands in for megatron's CUDA one."""

from __future__ import annotations

import pytest
import torch

from elastic_rl.model.cpu_shim import CpuRngStatesTracker

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_fork_draws_from_its_own_stream_and_restores_the_default():
    tracker = CpuRngStatesTracker()
    tracker.add("stream", 42)
    torch.manual_seed(0)
    expected_default = torch.rand(3)

    torch.manual_seed(0)
    with tracker.fork("stream"):
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_default)

    with tracker.fork("stream"):
        second = torch.rand(3)
    torch.manual_seed(42)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))


def test_duplicate_names_and_seeds_are_refused():
    tracker = CpuRngStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError):
        tracker.add("a", 2)
    with pytest.raises(ValueError):
        tracker.add("b", 1)
    with pytest.raises(KeyError):
        with tracker.fork("missing"):
            pass
