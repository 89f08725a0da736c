"""Which GPUs `erl daemon --gpus` offers and what a slot's process is told its GPU is (daemon.gpus),
against a fake NVML."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from daemon.gpus import node_gpus
from daemon.plan import device_env
from elastic_rl import jobenv
from elastic_rl.errors import InputError
from policies.devices import DeviceKind, ProcessDevice

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

GIB = 1024**3

# (UUID, PCI bus) in NVML's enumeration order, which here is not the PCI bus order CUDA numbers them in.
MACHINE = [("GPU-cccc-2", 0x61), ("GPU-aaaa-0", 0x07), ("GPU-dddd-3", 0x8A), ("GPU-bbbb-1", 0x3B)]


class FakeNvml:
    """Stands in for pynvml: NVML seeing ``gpus`` (UUID, PCI bus) in its order, or failing to start."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: list, fails: bool = False):
        self.gpus, self.fails, self.open = gpus, fails, False

    def nvmlInit(self) -> None:
        if self.fails:
            raise self.NVMLError("Driver Not Loaded")
        self.open = True

    def nvmlShutdown(self) -> None:
        self.open = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int):
        return self.gpus[handle][0]

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(domain=0, bus=self.gpus[handle][1], device=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=GIB * (80 + handle))


def gpus(request: str, environ: dict[str, str], machine=MACHINE) -> tuple[str, ...]:
    nvml = FakeNvml(machine)
    found = node_gpus(request, nvml, environ)
    assert not nvml.open
    return found.cuda_indices


def test_slots_name_their_gpus_in_pci_bus_order_whatever_order_nvml_lists_them_in():
    assert gpus("all", {}) == ("0", "1", "2", "3")  # GPU-aaaa-0 (bus 07) is CUDA's device 0, and slot 0
    assert gpus("2", {}) == ("0", "1")
    assert gpus("all", {}, machine=[(b"GPU-aaaa-0", 0x07)]) == ("0",)  # older bindings give bytes


def test_an_inherited_restriction_offers_only_the_gpus_it_lists_in_its_order():
    # Its numbers are read in PCI bus order, as CUDA reads them under CUDA_DEVICE_ORDER=PCI_BUS_ID.
    assert gpus("all", {jobenv.CUDA_VISIBLE_DEVICES: "2,0"}) == ("2", "0")
    assert gpus("1", {jobenv.CUDA_VISIBLE_DEVICES: "2,0"}) == ("2",)
    by_uuid = {jobenv.CUDA_VISIBLE_DEVICES: "GPU-dddd-3, GPU-bbbb"}  # a unique start of a UUID, as CUDA takes
    assert gpus("all", by_uuid) == ("3", "1")
    with pytest.raises(InputError, match="has 2 GPU"):
        gpus("3", {jobenv.CUDA_VISIBLE_DEVICES: "2,0"})


def test_a_slot_holds_the_memory_of_the_smallest_gpu_offered():
    # The fake's GPU at NVML index i has 80 + i GiB: cccc-2 80, aaaa-0 81, dddd-3 82, bbbb-1 83.
    assert node_gpus("2", FakeNvml(MACHINE), {}).slot_memory == 81 * GIB  # aaaa-0 and bbbb-1
    assert node_gpus("all", FakeNvml(MACHINE), {jobenv.CUDA_VISIBLE_DEVICES: "3,1"}).slot_memory == 82 * GIB
    assert node_gpus("all", FakeNvml(MACHINE), {}).slot_memory == 80 * GIB


def test_the_slots_users_see_stay_0_to_n_minus_1():
    offered = gpus("all", {jobenv.CUDA_VISIBLE_DEVICES: "GPU-dddd-3,GPU-bbbb-1"})
    env = device_env(ProcessDevice(DeviceKind.CUDA, (0, 1)), offered)
    assert env[jobenv.SLOTS] == "0,1"
    assert env[jobenv.CUDA_VISIBLE_DEVICES] == "3,1" and env[jobenv.CUDA_DEVICE_ORDER] == "PCI_BUS_ID"


@pytest.mark.parametrize(
    "inherited, problem",
    [
        ("", "leaves it no GPU"),
        ("7", "no GPU 7"),
        ("GPU-zzzz", "names no GPU"),
        ("GPU-", "names 4 GPUs"),
        ("MIG-1234", "a MIG instance cannot be a slot"),
    ],
)
def test_an_inherited_restriction_that_names_no_usable_gpu_is_refused(inherited, problem):
    with pytest.raises(InputError, match=problem):
        gpus("all", {jobenv.CUDA_VISIBLE_DEVICES: inherited})


def test_numbers_without_pci_bus_order_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="erld.gpus"):
        gpus("all", {jobenv.CUDA_VISIBLE_DEVICES: "1", jobenv.CUDA_DEVICE_ORDER: "PCI_BUS_ID"})
        gpus("all", {jobenv.CUDA_VISIBLE_DEVICES: "GPU-aaaa-0"})
        assert not caplog.records
        gpus("all", {jobenv.CUDA_VISIBLE_DEVICES: "1"})
    assert "PCI bus order" in caplog.text


def test_no_nvml_points_at_cpu_devices():
    with pytest.raises(InputError, match="Driver Not Loaded.*--cpu-devices"):
        node_gpus("all", FakeNvml([], fails=True), {})
