"""The offloaded optimizer (trainer.optimizer_offload) on a GPU: the same steps as AdamW on the device
(within the two fused kernels' rounding), its moments off the device, through a heal, and in colocated
mode, where the handover leaves its state where it is."""

from __future__ import annotations

import copy

import pytest
import torch

from elastic_rl.trainer.host_adamw import HostAdamW
from elastic_rl.trainer.offload import Residency
from tests.gpu.conftest import require_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

WIDTH = 1024
SETTINGS = {"lr": 1e-3, "betas": (0.9, 0.98), "weight_decay": 0.01}


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    inputs = torch.randn(64, WIDTH, device="cuda", generator=generator)
    optimizer.zero_grad()
    model(inputs).square().mean().backward()
    optimizer.step()


def test_offloaded_steps_match_the_devices_and_keep_the_moments_off_it():
    require_gpus(1)
    torch.manual_seed(0)
    kept = torch.nn.Linear(WIDTH, WIDTH).cuda()
    offloaded = copy.deepcopy(kept)
    on_device = torch.optim.AdamW(kept.parameters(), fused=True, **SETTINGS)
    host = HostAdamW(offloaded.parameters(), **SETTINGS)
    for seed in range(3):
        step(kept, on_device, seed)
    held = torch.cuda.memory_allocated()
    for seed in range(3):
        step(offloaded, host, seed)
    # The second model's weights and gradients are on the device; its two moments (8 MB) are not.
    assert torch.cuda.memory_allocated() - held < 2 * 4 * WIDTH * (WIDTH + 1) + (1 << 20)
    assert all(value.device.type == "cpu" for state in host.state.values() for value in state.values())
    for a, b in zip(kept.parameters(), offloaded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    # A heal: another replica takes the state dict (a copy, as the transport sends it) and steps alike.
    healed = copy.deepcopy(offloaded)
    peer = HostAdamW(healed.parameters(), **SETTINGS)
    peer.load_state_dict(copy.deepcopy(host.state_dict()))
    for model, optimizer in ((offloaded, host), (healed, peer)):
        step(model, optimizer, 3)
    for a, b in zip(offloaded.parameters(), healed.parameters()):
        assert torch.equal(a, b)


def test_colocated_handover_moves_the_weights_and_leaves_the_moments_in_host_memory():
    require_gpus(1)
    model = torch.nn.Linear(WIDTH, WIDTH).cuda()
    optimizer = HostAdamW(model.parameters(), **SETTINGS)
    step(model, optimizer, 0)
    moments = {id(value) for state in optimizer.state.values() for value in state.values()}
    residency = Residency([model], [], torch.device("cuda"), timeout_s=60)
    residency.offload()
    assert all(p.device.type == "cpu" for p in model.parameters())
    residency.onload()
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert {id(value) for state in optimizer.state.values() for value in state.values()} == moments
    step(model, optimizer, 1)
