"""Colocated mode's pure parts: what the spec allows, where engines go, what the turns report."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from chaos.scenario import At
from daemon.cluster import colocated_with, held_slots
from daemon.plan import engine_group, job_groups
from elastic_rl.rollout.handover import slot_memory_metrics
from elastic_rl.spec.loading import load_spec
from elastic_rl.trainer.offload import Residency
from policies.capacity import Size, colocated_engines
from policies.exits import EXIT_HANDOVER_HUNG
from policies.placement import Group, GroupKind, place_groups
from tests.processes import REPO
from tests.unit.test_config import problems

COLOCATED = REPO / "examples" / "tiny-grpo-colocated.yaml"


def test_the_engines_follow_the_replicas_and_take_no_slot_of_their_own():
    spec = load_spec(COLOCATED, ["trainer.replicas={min: 1, max: 3}", "trainer.tensor_parallel=2"])
    assert spec.engines_per_replica == 2
    assert (spec.engine_range.min, spec.engine_range.max) == (2, 6)
    assert spec.declared_sizes == {"replicas": (1, 3), "engines": (2, 6)}
    assert spec.devices_needed == 6  # three replicas of two ranks; the six engines share their slots
    engines = [g for g in job_groups(spec) if g.kind is GroupKind.ENGINE]
    assert [(g.name, g.host, g.host_slots) for g in engines[:3]] == [
        ("engine-0", "replica-0", (0,)),
        ("engine-1", "replica-0", (1,)),
        ("engine-2", "replica-1", (0,)),
    ]
    disaggregated = load_spec(COLOCATED, ["placement=disaggregated"])
    assert disaggregated.engine_count == 2 and not engine_group(disaggregated, 0).host


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["engines.count=2"], "remove engines.count"),
        (["rollout.mode=async"], "set rollout.mode sync"),
        (["fault_tolerance.warm_spares=1"], "fault_tolerance.warm_spares 0"),
        (["engines.weight_sync=distributed"], "use memory or disk"),
        (["debug.rollout_only=true"], "remove debug.rollout_only"),
    ],
)
def test_what_colocation_cannot_do_is_refused_naming_the_fields(overrides, named):
    (problem,) = problems(COLOCATED, *overrides)
    assert "placement colocated" in problem and named in problem, problem


def test_weights_in_memory_need_colocation():
    (problem,) = problems(COLOCATED, "placement=disaggregated", "engines.weight_sync=memory")
    assert "engines.weight_sync memory" in problem and "set placement colocated" in problem


def test_a_colocated_engine_goes_onto_its_replicas_slots_wherever_that_is():
    replica = Group("replica-0", GroupKind.REPLICA, 2)
    engines = [Group(f"engine-{j}", GroupKind.ENGINE, 1, host="replica-0", host_slots=(j,)) for j in range(2)]
    placed = place_groups([*engines, replica], {"a": [0], "b": [3, 5, 6]})
    assert placed.complete
    assert placed.assigned == {"replica-0": ("b", (3, 5)), "engine-0": ("b", (3,)), "engine-1": ("b", (5,))}
    # The replica already runs: its engine goes back onto its slots, taking no free one.
    again = place_groups([engines[1]], {"b": [6]}, held={"replica-0": ("b", (3, 5))})
    assert again.assigned == {"engine-1": ("b", (5,))}
    # No room for the replica: none for its engines either.
    none = place_groups([replica, engines[0]], {"a": [0]})
    assert none.unplaced == ("replica-0", "engine-0") and "on the slots of replica-0" in none.reason


def test_a_colocated_unit_moves_together():
    wanted = {
        "replica-0": Group("replica-0", GroupKind.REPLICA, 2),
        "engine-0": Group("engine-0", GroupKind.ENGINE, 1, host="replica-0", host_slots=(0,)),
        "engine-1": Group("engine-1", GroupKind.ENGINE, 1, host="replica-1", host_slots=(0,)),
    }
    groups = {
        "replica-0": {"trainer-0-1": {"node": "n", "device": 4}, "trainer-0-0": {"node": "n", "device": 2}},
        "engine-0": {"engine-0": {"node": "n", "device": 2}},
        "engine-1": {"engine-1": {"node": "n", "device": 7}},
    }
    assert held_slots(groups)["replica-0"] == ("n", (2, 4))  # in rank order
    moved = colocated_with({"replica-0": "node n is gone"}, groups, wanted)
    assert moved == {"engine-0": "it shares the slots of replica-0, which moves (node n is gone)"}


def test_scaling_the_replicas_scales_their_engines():
    assert colocated_engines(Size(1, 3), 2) == Size(2, 6)
    assert colocated_engines(Size(1, 3, pinned=2), 2) == Size(2, 6, pinned=4)


def test_each_slot_reports_its_peak_in_each_phase_and_what_sharing_saved():
    gib = 2**30
    metrics = slot_memory_metrics(
        engine_generation={"n/0": 3 * gib},
        engine_training={"n/0": 1 * gib},
        trainer_generation={"n/0": 1 * gib},
        trainer_training={"n/0": 4 * gib},
    )
    assert metrics["memory/n/0/generation_peak_bytes"] == 4 * gib
    assert metrics["memory/n/0/training_peak_bytes"] == 5 * gib
    assert metrics["memory/slot_peak_bytes_max"] == 5 * gib
    # Apart, the engine's slot would hold 3 GiB and the trainer's 4: 7 GiB against the shared slot's 5.
    assert metrics["memory/colocation_saved_bytes"] == 2 * gib
    assert slot_memory_metrics({}, {}, {}, {}) == {}


def test_a_rank_that_cannot_offload_in_time_exits_for_erld_to_restart_it(monkeypatch):
    model = torch.nn.Linear(2, 2)
    exits: list[int] = []
    ended = threading.Event()

    def exit_and_unblock(code: int) -> None:
        exits.append(code)
        ended.set()

    residency = Residency([model], [torch.optim.AdamW(model.parameters())], torch.device("cpu"), 0.2, exit_and_unblock)
    assert residency.offload() < 0.2 and not residency.on_device and not exits  # a no-op on a CPU slot
    monkeypatch.setattr(residency, "device", torch.device("meta"))  # any device that is not the host
    monkeypatch.setattr(residency, "_move_tensors", lambda where: ended.wait(5))
    started = time.monotonic()
    residency.onload()
    assert exits == [EXIT_HANDOVER_HUNG] and time.monotonic() - started < 5


def test_a_chaos_phase_names_a_rollout():
    assert At(rollout=3, during="training").during.value == "training"
    with pytest.raises(ValueError, match="give it with rollout"):
        At(seconds=3.0, during="generation")
