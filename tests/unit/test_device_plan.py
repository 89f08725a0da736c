"""How erld carries the device rule to a job's processes: slots per group, assignments that hold
several slots, each process's environment on CPU and GPU nodes, and `--gpus`."""

from __future__ import annotations

import pytest

from daemon.controller import Controller
from daemon.gpus import slots_for
from daemon.plan import Endpoints, job_groups, proc_spec, process_env
from elastic_rl import jobenv
from elastic_rl.errors import InputError, SpecError
from elastic_rl.spec.loading import validate_spec
from elastic_rl.store.devices import assignment_slots, used_slots
from policies.devices import DeviceKind
from policies.placement import GroupKind

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ENDPOINTS = Endpoints(router="http://10.0.0.1:1", lighthouse="http://10.0.0.1:2")
NODES = {"gpu-a": {"advertise_host": "10.0.0.2"}}


GPU_IDS = tuple(str(7 - slot) for slot in range(8))
"""The node's GPUs as CUDA numbers them, slot i's at i (here in the reverse order)."""


def env_of(name: str, assignment: dict, spec, kind: DeviceKind) -> dict[str, str]:
    assignment = {"generation": 1, **assignment}
    return process_env(proc_spec(name), assignment, ENDPOINTS, {}, "10.0.0.2", spec, kind, GPU_IDS)


@pytest.fixture
def sglang_job(sglang_installed):
    return validate_spec(
        {
            "name": "j",
            "engines": {"kind": "sglang", "tp_size": 2, "count": 1},
            "trainer": {"dtype": "bf16", "tensor_parallel": 2},
        }
    )


def test_an_sglang_engine_group_takes_tp_size_slots_and_needs_cuda(sglang_job):
    groups = {g.name: g for g in job_groups(sglang_job)}
    assert groups["engine-0"].slots == 2 and groups["engine-0"].cuda_only
    assert groups["replica-0"].slots == 2 and groups["replica-0"].cuda_only  # bf16
    cpu_groups = {g.name: g for g in job_groups(validate_spec({"name": "j"}))}
    assert cpu_groups["engine-0"].slots == 1 and not cpu_groups["engine-0"].cuda_only
    assert not cpu_groups["replica-0"].cuda_only


def test_an_engine_assignment_holds_every_slot_of_its_group(sglang_job):
    engine = next(g for g in job_groups(sglang_job) if g.kind is GroupKind.ENGINE)
    made = Controller._assign(engine, "gpu-a", (4, 5), NODES, generation=3)
    assert made["engine-0"]["device"] == 4 and made["engine-0"]["devices"] == [4, 5]
    assert assignment_slots(made["engine-0"]) == (4, 5)
    used = used_slots({"j": {"phase": "running"}}, {"j": made})
    assert used == {"gpu-a": {4, 5}}
    # A one-slot assignment is written as before.
    replica = next(g for g in job_groups(validate_spec({"name": "j"})) if g.kind is GroupKind.REPLICA)
    assert "devices" not in Controller._assign(replica, "gpu-a", (1,), NODES, generation=3)["trainer-0-0"]
    assert assignment_slots({"device": None}) == ()


def test_a_trainer_on_a_gpu_node_sees_its_gpu_and_gets_nccl_hygiene():
    spec = validate_spec({"name": "j", "fault_tolerance": {"quorum_timeout_s": 40, "collective_timeout_s": 20}})
    env = env_of("trainer-0-1", {"device": 6}, spec, DeviceKind.CUDA)
    assert env[jobenv.DEVICE_KIND] == "cuda" and env[jobenv.CUDA_VISIBLE_DEVICES] == "1" and env[jobenv.SLOTS] == "6"
    assert env[jobenv.CUDA_DEVICE_ORDER] == "PCI_BUS_ID" and env[jobenv.CUBLAS_WORKSPACE_CONFIG] == ":4096:8"
    assert env[jobenv.NCCL_HEARTBEAT_TIMEOUT] == "20"  # below the 40 s quorum timeout
    assert env[jobenv.NCCL_RETHROW_CUDA_ERRORS] == "0"
    assert env[jobenv.NCCL_NONBLOCKING_TIMEOUT] == "20"
    assert env["RANK"] == "1" and env[jobenv.DEVICE] == "6"


def test_an_sglang_engine_sees_all_its_gpus_without_trainer_nccl_settings(sglang_job):
    env = env_of("engine-0", {"device": 2, "devices": [2, 3], "port": 30000}, sglang_job, DeviceKind.CUDA)
    assert env[jobenv.DEVICE_KIND] == "cuda" and env[jobenv.CUDA_VISIBLE_DEVICES] == "5,4"
    assert env[jobenv.SLOTS] == "2,3"
    assert jobenv.NCCL_HEARTBEAT_TIMEOUT not in env
    assert env[jobenv.SGLANG_HEALTH_GENERATION] == "0"  # /health answers while weights load


def test_a_cpu_node_and_a_cpu_engine_see_no_gpu():
    spec = validate_spec({"name": "j"})
    for name, assignment, kind in [
        ("trainer-0-0", {"device": 1}, DeviceKind.CPU),
        ("engine-0", {"device": 1, "port": 30000}, DeviceKind.CUDA),  # a cpu engine on a GPU node
        ("orchestrator", {"device": None}, DeviceKind.CUDA),
    ]:
        env = env_of(name, assignment, spec, kind)
        assert env[jobenv.DEVICE_KIND] == "cpu" and env[jobenv.CUDA_VISIBLE_DEVICES] == "", name
        assert jobenv.NCCL_HEARTBEAT_TIMEOUT not in env and jobenv.CUBLAS_WORKSPACE_CONFIG not in env
        assert jobenv.SGLANG_HEALTH_GENERATION not in env


def test_gpus_all_or_a_count_of_the_gpus_nvml_found():
    assert slots_for("all", 8) == 8
    assert slots_for("2", 8) == 2
    with pytest.raises(InputError, match="this node has 2 GPU"):
        slots_for("4", 2)
    with pytest.raises(InputError, match="no GPU"):
        slots_for("all", 0)
    with pytest.raises(InputError, match="give `all` or a number"):
        slots_for("two", 2)
    with pytest.raises(InputError, match="at least 1"):
        slots_for("0", 2)


def test_a_weight_broadcast_over_nccl_puts_the_trainers_on_gpus(sglang_installed):
    spec = validate_spec({"name": "j", "engines": {"kind": "sglang", "weight_sync": "distributed"}})
    assert all(g.cuda_only for g in job_groups(spec) if g.kind in (GroupKind.REPLICA, GroupKind.ENGINE))


def test_a_replica_holds_a_slot_for_every_tensor_pipeline_and_data_parallel_rank():
    trainer = {"replicas": 2, "tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel": 3}
    spec = validate_spec({"name": "j", "trainer": trainer, "engines": {"count": 1}})
    replicas = [group for group in job_groups(spec) if group.kind is GroupKind.REPLICA]
    assert [group.slots for group in replicas] == [12, 12]
    assert spec.devices_needed == 1 + 2 * 12
    env = env_of("trainer-1-11", {"device": 11}, spec, DeviceKind.CPU)
    assert env["RANK"] == "11" and env["WORLD_SIZE"] == "12"


@pytest.mark.parametrize("field", ["data_parallel", "pipeline_parallel"])
def test_colocated_replicas_with_data_parallel_ranks_or_stages_are_refused(field):
    with pytest.raises(SpecError, match=f"trainer.{field}"):
        validate_spec({"name": "j", "placement": "colocated", "trainer": {field: 2}})


def test_pipeline_stages_must_split_the_layers_evenly():
    with pytest.raises(SpecError, match=r"model.num_layers \(3\) must be a multiple of trainer.pipeline_parallel"):
        validate_spec({"name": "j", "model": {"num_layers": 3}, "trainer": {"pipeline_parallel": 2}})
    assert validate_spec({"name": "j", "model": {"num_layers": 4}, "trainer": {"pipeline_parallel": 4}})
