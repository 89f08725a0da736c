"""Sharing requests by engine pace, branch by branch (``policies.engine_pace``), and the meter that measures
the paces from engines' loads and picks the engine for each request (``elastic_rl.engines.pace``)."""

from __future__ import annotations

from collections import Counter

import pytest

from elastic_rl.engines.pace import MIN_SAMPLES, SAMPLES, PaceMeter
from policies.engine_health import EngineLoad
from policies.engine_pace import judge

pytestmark = pytest.mark.timeout(10)


def test_an_engine_at_a_quarter_of_its_peers_pace_gets_a_quarter_of_a_peers_share():
    verdict = judge({"a": 40.0, "b": 40.0, "c": 10.0}, 2.0)
    assert verdict.slow(2.0) == ["c"]
    assert verdict.ratios["c"] == pytest.approx(0.25) and verdict.slowest == pytest.approx(0.25)
    assert verdict.shares == pytest.approx({"a": 4 / 9, "b": 4 / 9, "c": 1 / 9})


def test_every_engine_slow_is_none_slow():
    """The overload rule: paces are compared with peers', never with a fixed rate."""
    verdict = judge({"a": 5.0, "b": 5.0, "c": 5.0}, 2.0)
    assert verdict.shares is None and verdict.slow(2.0) == [] and verdict.slowest == 1.0


def test_an_engine_slower_by_less_than_the_factor_keeps_an_even_share():
    verdict = judge({"a": 40.0, "b": 25.0}, 2.0)
    assert verdict.shares is None and verdict.slowest == pytest.approx(25 / 40)


def test_an_engine_not_measured_yet_counts_at_its_peers_median():
    verdict = judge({"a": 40.0, "b": 40.0, "c": 10.0, "new": None}, 2.0)
    assert "new" not in verdict.ratios
    assert verdict.shares["new"] == verdict.shares["a"] == pytest.approx(40 / 130)


def test_one_engine_or_the_rule_off_shares_evenly():
    assert judge({"a": 10.0}, 2.0).shares is None
    assert judge({"a": 10.0, "b": None}, 2.0).shares is None
    assert judge({"a": 40.0, "b": 1.0}, None).shares is None


def loads(tokens: dict[str, int], running: dict[str, int]) -> dict[str, EngineLoad]:
    return {
        url: EngineLoad(
            progress=count, holding_work=running[url] > 0, generated_tokens=count, running_requests=running[url]
        )
        for url, count in tokens.items()
    }


LAST = MIN_SAMPLES
"""The second of ``measured``'s last read: just enough intervals for a pace."""


def measured(meter: PaceMeter, rates: dict[str, int], running: int = 4, reads: int = LAST + 1) -> None:
    """``reads`` reads a second apart from second 0, each engine generating ``rates[url]`` tokens a second
    while running ``running`` requests."""
    for second in range(reads):
        meter.read(loads({url: rate * second for url, rate in rates.items()}, dict.fromkeys(rates, running)), second)


def test_the_meter_measures_tokens_per_second_per_running_request():
    meter = PaceMeter(2.0)
    measured(meter, {"fast": 80, "slow": 20})
    assert meter.verdict.ratios == pytest.approx({"fast": 4.0, "slow": 0.25})
    picks = Counter(meter.pick() for _ in range(100))
    assert picks == {"fast": 80, "slow": 20}
    assert meter.paced_requests == 100


def test_an_engine_running_fewer_requests_is_not_judged_slower_for_it():
    meter = PaceMeter(2.0)
    for second in range(5):
        meter.read(loads({"a": 80 * second, "b": 20 * second}, {"a": 8, "b": 2}), second)
    assert meter.verdict.shares is None and meter.pick() is None


def test_paces_need_enough_samples_and_forget_engines_that_went():
    meter = PaceMeter(2.0)
    measured(meter, {"fast": 80, "slow": 20}, reads=LAST)
    assert meter.verdict.shares is None  # one interval short of a pace
    meter.read(loads({"fast": 80 * LAST, "slow": 20 * LAST}, {"fast": 4, "slow": 4}), LAST)
    assert meter.verdict.shares is not None
    meter.read(loads({"fast": 80 * (LAST + 1)}, {"fast": 4}), LAST + 1)
    assert meter.verdict.shares is None and meter.pick() is None


def test_a_recovered_engine_is_measured_again_and_taken_back_at_full_share():
    meter = PaceMeter(2.0)
    measured(meter, {"fast": 80, "slow": 20})
    assert meter.verdict.slow(2.0) == ["slow"]
    for second in range(LAST + 1, LAST + SAMPLES + 1):  # it keeps getting its share: measured at full pace
        slow_tokens = 20 * LAST + 80 * (second - LAST)
        meter.read(loads({"fast": 80 * second, "slow": slow_tokens}, {"fast": 4, "slow": 4}), second)
    assert meter.verdict.shares is None


def test_a_restarted_engine_starts_its_measure_over():
    meter = PaceMeter(2.0)
    measured(meter, {"fast": 80, "slow": 20})
    meter.read(loads({"fast": 80 * (LAST + 1), "slow": 0}, {"fast": 4, "slow": 0}), LAST + 1)  # back to 0
    assert "slow" not in meter.verdict.ratios and meter.verdict.shares is None


def test_an_engine_that_does_not_answer_keeps_its_measure():
    meter = PaceMeter(2.0)
    measured(meter, {"fast": 80, "slow": 20})
    meter.read({"fast": loads({"fast": 80 * (LAST + 1)}, {"fast": 4})["fast"], "slow": None}, LAST + 1)
    assert meter.verdict.slow(2.0) == ["slow"]
