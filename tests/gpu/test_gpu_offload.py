"""Colocated mode's trainer side on a GPU: offloading gives the device memory back, and training after
the state comes back is what it would have been without the round trip."""

from __future__ import annotations

import pytest
import torch

from elastic_rl.trainer.gradient_buffer import view_gradients
from elastic_rl.trainer.offload import Residency
from tests.gpu.conftest import require_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = torch.randn(64, 1024, device="cuda", generator=generator)
    optimizer.zero_grad()
    model(inputs).square().mean().backward()
    optimizer.step()


def test_offload_frees_the_device_and_onload_trains_on_unchanged():
    require_gpus(1)
    torch.manual_seed(0)
    models = [torch.nn.Linear(1024, 1024).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), fused=True) for m in models]
    for model, optimizer in zip(models, optimizers):
        step(model, optimizer)
    residency = Residency([models[1]], [optimizers[1]], torch.device("cuda"), timeout_s=60)
    held = torch.cuda.memory_allocated()
    residency.offload()
    # Parameters, gradients and both AdamW moments of one model: about four times its 4 MB left the device.
    assert held - torch.cuda.memory_allocated() >= 4 * 4 * 1024 * 1024
    assert all(p.device.type == "cpu" for p in models[1].parameters())
    residency.onload()
    for model, optimizer in zip(models, optimizers):
        step(model, optimizer)
    for kept, moved in zip(models[0].parameters(), models[1].parameters()):
        assert moved.device.type == "cuda" and torch.equal(kept, moved)


def test_gradients_held_in_a_flat_buffer_stay_in_it_through_the_round_trip():
    """As the trainer holds them (``trainer.gradient_buffer``): after offload and onload the backward pass
    still accumulates into the buffer the step all-reduces."""
    require_gpus(1)
    model = torch.nn.Linear(1024, 1024).cuda()
    parameters = list(model.parameters())
    held = {"buffer": torch.zeros(sum(p.numel() for p in parameters), device="cuda")}
    view_gradients(parameters, held["buffer"])

    def move(where: torch.device) -> None:
        held["buffer"] = held["buffer"].to(where)
        view_gradients(parameters, held["buffer"])

    residency = Residency([model], [], torch.device("cuda"), timeout_s=60, gradients=move)
    residency.offload()
    assert held["buffer"].device.type == "cpu" and model.weight.device.type == "cpu"
    residency.onload()
    held["buffer"].zero_()
    model(torch.ones(4, 1024, device="cuda")).sum().backward()
    assert held["buffer"].device.type == "cuda" and held["buffer"].abs().sum() > 0
    assert model.weight.grad.data_ptr() == held["buffer"].data_ptr()
