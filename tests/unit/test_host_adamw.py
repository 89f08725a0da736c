"""The offloaded optimizer (trainer.optimizer_offload, ``trainer.host_adamw``): AdamW's steps, bit for bit,
with its state in host memory, and state dicts that pass between it and torch's AdamW both ways (what a
snapshot or a heal across the setting does)."""

from __future__ import annotations

import copy

import pytest
import torch

from elastic_rl.trainer.host_adamw import HostAdamW

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.98), "weight_decay": 0.1}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=False))


def train(module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        inputs = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        module(inputs).square().sum().backward()
        for group in optimizer.param_groups:
            group["lr"] = SETTINGS["lr"] / (step + 1)  # as the schedule sets it
        optimizer.step()


def assert_same_weights(*modules: torch.nn.Module) -> None:
    for params in zip(*(module.parameters() for module in modules)):
        assert all(torch.equal(params[0], other) for other in params[1:])


def test_its_steps_are_adamws_bit_for_bit_and_its_state_is_in_host_memory():
    kept, offloaded = model(), model()
    adamw = torch.optim.AdamW(kept.parameters(), fused=True, **SETTINGS)
    host = HostAdamW(offloaded.parameters(), **SETTINGS)
    train(kept, adamw, range(5))
    train(offloaded, host, range(5))
    assert_same_weights(kept, offloaded)
    for param in offloaded.parameters():
        state = host.state[param]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 5
        assert all(value.device.type == "cpu" for value in state.values())


def test_a_state_dict_passes_between_it_and_adamw_both_ways():
    reference = model()
    adamw = torch.optim.AdamW(reference.parameters(), fused=True, **SETTINGS)
    train(reference, adamw, range(3))
    # An offloaded replica healed from one without offload takes a step, then heals one without offload.
    offloaded = copy.deepcopy(reference)
    host = HostAdamW(offloaded.parameters(), **SETTINGS)
    host.load_state_dict(copy.deepcopy(adamw.state_dict()))
    assert all(value.device.type == "cpu" for state in host.state.values() for value in state.values())
    train(offloaded, host, range(3, 4))
    healed = copy.deepcopy(offloaded)
    kept = torch.optim.AdamW(healed.parameters(), fused=True, **SETTINGS)
    kept.load_state_dict(copy.deepcopy(host.state_dict()))  # as a heal sends it: no tensor shared
    train(reference, adamw, range(3, 6))
    train(offloaded, host, range(4, 6))
    train(healed, kept, range(4, 6))
    assert_same_weights(reference, offloaded, healed)
