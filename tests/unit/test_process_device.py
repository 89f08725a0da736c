"""Inside a process: the device erld assigned it, read back from the environment, and what it
means for megatron's config."""

from __future__ import annotations

import pytest
import torch

from elastic_rl import device, jobenv
from elastic_rl.errors import WrongDevice
from elastic_rl.model.gpt import transformer_config
from elastic_rl.spec.model import ModelSpec
from policies.devices import DeviceKind, Precision, ProcessDevice

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_a_process_erld_did_not_start_is_a_cpu_process(monkeypatch):
    monkeypatch.delenv(jobenv.DEVICE_KIND, raising=False)
    monkeypatch.setenv(jobenv.CUDA_VISIBLE_DEVICES, "0,1")
    assert device.assigned() == ProcessDevice(DeviceKind.CPU)
    assert device.activate(device.assigned()) == torch.device("cpu")


def test_a_gpu_process_reads_its_slots_back(monkeypatch):
    monkeypatch.setenv(jobenv.DEVICE_KIND, "cuda")
    monkeypatch.setenv(jobenv.SLOTS, "4,5")
    monkeypatch.setenv(jobenv.CUDA_VISIBLE_DEVICES, "GPU-1234,GPU-5678")  # the same GPUs, by UUID
    assert device.assigned() == ProcessDevice(DeviceKind.CUDA, (4, 5))


def test_a_gpu_slot_and_a_torch_without_cuda_is_the_wrong_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)  # as in the CPU build of torch
    with pytest.raises(WrongDevice, match=r"GPU slot\(s\) \[3\].*no CUDA device.*built without CUDA"):
        device.activate(ProcessDevice(DeviceKind.CUDA, (3,)))


def test_a_cuda_build_that_sees_no_gpu_is_a_crash_not_the_wrong_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a driver or device fault a restart may get past
    with pytest.raises(RuntimeError, match=r"no CUDA device.*built for CUDA 12.8") as raised:
        device.activate(ProcessDevice(DeviceKind.CUDA, (3,)))
    assert not isinstance(raised.value, WrongDevice)


def test_bf16_is_megatrons_autocast_over_fp32_parameters():
    arch = ModelSpec().toy_architecture(64)
    fp32 = transformer_config(arch, 1)
    assert not fp32.enable_autocast and fp32.params_dtype == torch.float32
    mixed = transformer_config(arch, 1, Precision.BF16)
    assert mixed.enable_autocast and mixed.autocast_dtype == torch.bfloat16
    assert mixed.params_dtype == torch.float32 and not mixed.bf16  # fp32 main parameters and gradients


def test_bf16_params_is_megatrons_bf16_built_in_fp32_then_cast():
    arch = ModelSpec().toy_architecture(64)
    config = transformer_config(arch, 1, Precision.BF16_PARAMS)
    # The seed draws the same fp32 weights as in fp32; megatron's Float16Module casts them, and its
    # attention, built for bf16, takes the softmax in fp32.
    assert config.bf16 and config.params_dtype == torch.float32 and not config.enable_autocast
