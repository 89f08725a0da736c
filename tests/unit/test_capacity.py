"""Ranges of replicas and engines: the spec's `{min, max}`, which missing groups a job needs and which
are growth, and placement that fills every need before any growth."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastic_rl.spec.loading import load_spec
from policies.capacity import OutOfRange, Size, Sweep, current_sizes, in_sweep, mark_growth, rescale
from policies.placement import Group, GroupKind, place_groups
from tests.processes import SPEC
from tests.unit.test_config import problems

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def replica(k: int) -> Group:
    return Group(f"replica-{k}", GroupKind.REPLICA, 1)


def engine(i: int) -> Group:
    return Group(f"engine-{i}", GroupKind.ENGINE, 1)


def test_a_number_is_a_fixed_size_and_a_range_is_min_to_max():
    fixed = load_spec(SPEC, ["engines.count=3"])
    assert fixed.declared_sizes["engines"] == (3, 3) and fixed.engine_count == 3 and fixed.engines.count.fixed
    ranged = load_spec(SPEC, ["trainer.replicas={min: 1, max: 3}"])
    assert ranged.declared_sizes["replicas"] == (1, 3) and ranged.trainer_groups == (3, 0)
    assert ranged.devices_needed == 2 + 3  # at its largest: what `erl run` sizes its erld by


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.replicas={min: 3, max: 2}", "trainer.replicas: min (3) is above max (2)"),
        ("trainer.replicas={min: 1}", "trainer.replicas.max: required field is missing"),
        ("engines.count={min: 0, max: 2}", "engines.count.min: Input should be greater than 0"),
        ("engines.count=0", "engines.count: Input should be greater than 0"),
    ],
)
def test_a_bad_range_names_its_field(override, message):
    (problem,) = problems(SPEC, override)
    assert message in problem


def test_a_job_needs_its_minimum_by_count_whichever_groups_are_gone():
    minimums = {GroupKind.REPLICA: 2, GroupKind.ENGINE: 1}
    # replica-0 died; replica-1 and replica-2 still run: two held, the minimum, so replica-0 is growth.
    marked = mark_growth([replica(0), replica(3)], [replica(1), replica(2)], minimums)
    assert [(g.name, g.growth) for g in marked] == [("replica-0", True), ("replica-3", True)]
    # One held: the lowest missing index is needed, the rest are growth.
    marked = mark_growth([replica(3), replica(0), replica(2)], [replica(1)], minimums)
    assert [(g.name, g.growth) for g in marked] == [("replica-0", False), ("replica-2", True), ("replica-3", True)]
    # The services are always needed; a warm spare never is: it comes after every job's growth.
    services, spare = Group("services", GroupKind.SERVICES, 0), Group("spare-0", GroupKind.SPARE, 1)
    assert not mark_growth([services], [], minimums)[0].growth
    assert in_sweep(mark_growth([spare, replica(2)], [replica(0), replica(1)], minimums), Sweep.SPARES) == [
        replace(spare, growth=True)
    ]
    assert [g.name for g in in_sweep(marked, Sweep.GROWTH)] == ["replica-2", "replica-3"]
    assert [g.name for g in in_sweep(marked, Sweep.NEEDED)] == ["replica-0"]


def test_needs_are_placed_before_growth_and_growth_without_room_does_not_block():
    minimums = {GroupKind.REPLICA: 1, GroupKind.ENGINE: 1}
    wanted = mark_growth([replica(0), replica(1), replica(2), engine(0), engine(1)], [], minimums)
    # Three slots: the needed replica and engine first, then replica-1 (growth, lowest index first).
    placement = place_groups(wanted, {"a": [0, 1, 2]})
    assert placement.complete
    assert set(placement.assigned) == {"replica-0", "engine-0", "replica-1"}
    assert placement.not_grown == ("replica-2", "engine-1") and placement.unplaced == ()
    # One slot: a need is left without room, and that, not growth, makes it incomplete.
    placement = place_groups(wanted, {"a": [0]})
    assert not placement.complete and placement.unplaced == ("engine-0",)
    assert "engine-0" in placement.reason and "replica-1" not in placement.reason


def test_growth_takes_the_lowest_index_first_past_nine():
    minimums = {GroupKind.REPLICA: 1}
    wanted = mark_growth([replica(k) for k in range(12)], [], minimums)
    placement = place_groups(wanted, {"a": [0, 1, 2]})
    assert set(placement.assigned) == {"replica-0", "replica-1", "replica-2"}


def test_erl_scale_pins_a_count_within_the_range_or_sets_a_new_range():
    declared = Size(1, 3)
    assert rescale(declared, 2).bounds == (2, 2) and rescale(declared, 2).least == 1
    assert rescale(rescale(declared, 2), 3).bounds == (3, 3)  # the range stays: another count within it
    assert rescale(rescale(declared, 2), (2, 5)) == Size(2, 5)  # a new range drops the pin
    assert str(rescale(declared, (2, 2))) == "2" and str(declared) == "1..3"


@pytest.mark.parametrize(
    "asked, ceiling, message",
    [
        (4, None, "4 is outside the job's range 1..3"),
        ((3, 2), None, "3:2 is not a range"),
        ((1, 4), 3, "1:4 goes above 3, the most the job was submitted for"),
    ],
)
def test_erl_scale_refuses_what_the_range_does_not_allow(asked, ceiling, message):
    with pytest.raises(OutOfRange, match=message):
        rescale(Size(1, 3), asked, ceiling)


def test_sizes_come_from_erl_scale_where_it_set_them_else_from_the_spec():
    declared = {"replicas": (1, 3), "engines": (2, 2)}
    sizes = current_sizes(declared, {"engines": [2, 4, 3]})
    assert sizes[GroupKind.REPLICA] == Size(1, 3) and sizes[GroupKind.ENGINE].bounds == (3, 3)
