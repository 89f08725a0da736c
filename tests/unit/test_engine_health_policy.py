"""policies.engine_health: a hang told apart from load, branch by branch."""

from __future__ import annotations

import pytest

from elastic_rl.engines import load_metrics
from policies.engine_health import EngineLoad, EngineWatch, judge

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

HANG_S = 10.0


def busy(progress: int) -> EngineLoad:
    return EngineLoad(progress, holding_work=True)


def idle(progress: int) -> EngineLoad:
    return EngineLoad(progress, holding_work=False)


def run(checks: list[tuple[float, EngineLoad | None]], start: float = 0.0) -> list[bool]:
    """The verdicts of a series of (time, what the check read) on an engine serving since ``start``."""
    watch, verdicts = EngineWatch(start), []
    for now, load in checks:
        verdict = judge(watch, load, now, HANG_S)
        watch = verdict.watch
        verdicts.append(verdict.unhealthy)
    return verdicts


def test_an_engine_that_answers_nothing_for_the_hang_timeout_is_hung():
    verdict = judge(EngineWatch(0.0, progress=5), None, HANG_S, HANG_S)
    assert verdict.unhealthy and "answered nothing" in verdict.reason and "hung or gone" in verdict.reason
    assert not judge(EngineWatch(0.0, progress=5), None, HANG_S - 0.1, HANG_S).unhealthy


def test_an_engine_that_holds_work_and_generates_nothing_is_hung_even_if_it_answers():
    verdicts = run([(t, busy(7)) for t in range(1, 12)])
    assert verdicts[:9] == [False] * 9 and verdicts[-1]
    verdict = judge(EngineWatch(0.0, progress=7), busy(7), 11.0, HANG_S)
    assert verdict.unhealthy and "held work and generated nothing" in verdict.reason


def test_an_idle_engine_that_answers_is_alive_however_long_it_waits():
    assert run([(t, idle(3)) for t in range(1, 60)]) == [False] * 59


def test_overload_every_check_late_but_the_counter_advancing_is_load_not_a_fault():
    # SIGSTOP bursts: most checks get no answer; each answer in between shows the counter moved on.
    checks = [(float(t), None if t % 4 else busy(t)) for t in range(1, 120)]
    assert not any(run(checks))


def test_the_first_answer_sets_the_counter_and_does_not_count_as_progress():
    # Busy from the start with a counter that never moves: no evidence after serving began.
    assert run([(5.0, busy(40)), (10.0, busy(40))]) == [False, True]


def test_a_silence_that_ends_before_the_timeout_clears_it():
    checks = [(1.0, busy(1)), *((t, None) for t in (3.0, 6.0, 9.0)), (10.0, busy(2)), (19.0, None)]
    assert run(checks) == [False] * 6


def test_the_load_is_read_from_sglang_metrics_names_with_labels_summed():
    page = (
        "# HELP sglang:generation_tokens_total x\n"
        'sglang:generation_tokens_total{model_name="m"} 120.0\n'
        'sglang:num_requests_total{model_name="m",is_streaming="true"} 2\n'
        'sglang:num_requests_total{model_name="m",is_streaming="false"} 3\n'
        'sglang:num_running_reqs{model_name="m"} 0.0\n'
        'sglang:num_queue_reqs{model_name="m"} 4.0\n'
        'sglang:token_usage{model_name="m"} 0.5\n'
    )
    assert load_metrics.parse(page) == EngineLoad(progress=125, holding_work=True, generated_tokens=120)
    assert load_metrics.parse(load_metrics.render(10, 2, 0, 0)) == EngineLoad(12, False, generated_tokens=10)
