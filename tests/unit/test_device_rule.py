"""The device rule (policies.devices): each process's device, backends and NCCL settings, for CPU and
CUDA slots, and placement by the kind of a node's slots."""

from __future__ import annotations

import pytest

from policies.devices import (
    Backend,
    CrossReplicaGroup,
    DeviceKind,
    Precision,
    ProcessDevice,
    cross_replica_group,
    nccl_settings,
    offload_problem,
    precision_problem,
    process_device,
)
from policies.placement import Group, GroupKind, place_groups

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

GPU_IDS = ("5", "4", "3", "2", "1", "0")
"""A node's GPUs as CUDA numbers them, slot i's at i (here in the reverse order)."""


def test_a_trainer_rank_on_a_cuda_slot_sees_that_gpu_alone_and_uses_nccl():
    device = process_device(DeviceKind.CUDA, (3,), uses_gpu=True)
    assert device == ProcessDevice(DeviceKind.CUDA, (3,))
    assert device.torch_device == "cuda:0"
    assert device.visible_devices(GPU_IDS) == "2"
    assert device.backend is Backend.NCCL


def test_an_engine_with_several_cuda_slots_sees_all_of_them():
    device = process_device(DeviceKind.CUDA, (4, 5), uses_gpu=True)
    assert device.visible_devices(GPU_IDS) == "1,0" and device.torch_device == "cuda:0"


def test_a_cpu_slot_means_gloo_and_no_gpu():
    device = process_device(DeviceKind.CPU, (3,), uses_gpu=True)
    assert device.kind is DeviceKind.CPU
    assert device.torch_device == "cpu"
    assert device.visible_devices(GPU_IDS) == ""  # a CPU slot never touches a GPU, even on a GPU machine
    assert device.backend is Backend.GLOO


@pytest.mark.parametrize("slots, uses_gpu", [((), True), ((2,), False)])
def test_services_and_cpu_engines_stay_on_the_cpu_of_a_gpu_node(slots, uses_gpu):
    device = process_device(DeviceKind.CUDA, slots, uses_gpu)
    assert device.kind is DeviceKind.CPU and device.visible_devices(GPU_IDS) == "" and device.backend is Backend.GLOO


def test_torchft_uses_gloo_on_cpu_and_the_chosen_nccl_group_on_cuda():
    cpu, cuda = ProcessDevice(DeviceKind.CPU, (0,)), ProcessDevice(DeviceKind.CUDA, (0,))
    assert cross_replica_group(cpu, CrossReplicaGroup.BABY_NCCL) is CrossReplicaGroup.GLOO
    assert cross_replica_group(cuda, CrossReplicaGroup.NCCL) is CrossReplicaGroup.NCCL
    assert cross_replica_group(cuda, CrossReplicaGroup.BABY_NCCL) is CrossReplicaGroup.BABY_NCCL
    with pytest.raises(ValueError, match="NCCL"):
        cross_replica_group(cuda, CrossReplicaGroup.GLOO)


def test_the_nccl_heartbeat_fires_before_the_quorum_gives_up():
    settings = nccl_settings(quorum_timeout_s=60.0, collective_timeout_s=45.5)
    assert settings.heartbeat_timeout_s == 30 < 60
    assert settings.nonblocking_timeout_s == 46
    assert settings.rethrow_cuda_errors is False
    assert nccl_settings(quorum_timeout_s=1.5, collective_timeout_s=0.2).heartbeat_timeout_s == 1


def test_bf16_needs_a_cuda_slot_and_says_which_field():
    assert precision_problem(ProcessDevice(DeviceKind.CUDA, (0,)), Precision.BF16) is None
    assert precision_problem(ProcessDevice(DeviceKind.CPU, (0,)), Precision.FP32) is None
    problem = precision_problem(ProcessDevice(DeviceKind.CPU, (0,)), Precision.BF16)
    assert problem is not None and "trainer.dtype" in problem and "--gpus" in problem
    assert precision_problem(ProcessDevice(DeviceKind.CUDA, (0,)), Precision.BF16_PARAMS) is None
    problem = precision_problem(ProcessDevice(DeviceKind.CPU, (0,)), Precision.BF16_PARAMS)
    assert problem is not None and "trainer.dtype bf16-params" in problem and "--gpus" in problem


# --- placement by the kind of a node's slots ---------------------------------------


def test_a_group_that_needs_cuda_goes_only_to_a_gpu_node():
    engine = Group("engine-0", GroupKind.ENGINE, 2, cuda_only=True)
    placement = place_groups([engine], {"cpu-a": [0, 1, 2], "gpu-b": [0, 1]}, kinds={"gpu-b": DeviceKind.CUDA})
    assert placement.assigned["engine-0"] == ("gpu-b", (0, 1))


def test_no_gpu_node_leaves_it_pending_with_the_reason():
    replica = Group("replica-0", GroupKind.REPLICA, 1, cuda_only=True)
    placement = place_groups([replica], {"cpu-a": [0, 1]})
    assert placement.unplaced == ("replica-0",)
    assert "replica-0 (1 CUDA slots on one node)" in placement.reason


def test_a_jobs_trainer_groups_stay_on_one_kind_of_node():
    kinds = {"gpu-a": DeviceKind.CUDA, "cpu-b": DeviceKind.CPU}
    replicas = [Group(f"replica-{k}", GroupKind.REPLICA, 1) for k in range(2)]
    placement = place_groups(replicas, {"gpu-a": [0, 1], "cpu-b": [0, 1, 2]}, kinds=kinds)
    # replica-0 takes the node with the most free slots; spreading would put replica-1 on the other
    # node, of the other kind: it joins replica-0 instead.
    assert [node for node, _ in placement.assigned.values()] == ["cpu-b", "cpu-b"]
    # Placed again beside a replica already on the GPU node: only GPU slots will do.
    existing = {"replica-0": (GroupKind.REPLICA, "gpu-a")}
    again = place_groups([replicas[1]], {"gpu-a": [], "cpu-b": [0]}, existing, kinds)
    assert again.unplaced == ("replica-1",)


def test_an_engine_may_go_to_either_kind_when_it_needs_no_gpu():
    placement = place_groups([Group("engine-0", GroupKind.ENGINE, 1)], {"gpu-a": [0]}, kinds={"gpu-a": DeviceKind.CUDA})
    assert placement.assigned["engine-0"] == ("gpu-a", (0,))


def test_an_offloaded_optimizer_needs_a_cuda_slot_and_says_which_field():
    assert offload_problem(ProcessDevice(DeviceKind.CUDA, (0,))) is None
    problem = offload_problem(ProcessDevice(DeviceKind.CPU, (0,)))
    assert problem is not None and "trainer.optimizer_offload" in problem and "--gpus" in problem
