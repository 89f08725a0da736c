"""What keeps a rollout on policy (``policies.determinism``), case by case, and both ends that apply it:
the orchestrator's events when a rollout breaks it, and the chaos report's checks of a whole run."""

from __future__ import annotations

import asyncio
import math

import orjson
import pytest

from chaos.invariants import check_logprob_gap, check_segment_versions
from checkpoints import layout
from checkpoints.rollout_log import write_rollout
from policies.determinism import LOGPROB_GAP_BOUND, logprob_gap_exceeded, versions_out_of_bounds
from tests.unit.test_rollout_state import commit, orchestrator, spec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_segments_from_the_served_version_or_within_the_bound_are_allowed():
    # Sync mode without a buffer: the rollout's own version and nothing else.
    assert versions_out_of_bounds([[3], [3, 3]], served=3, oldest_allowed=3) == []
    assert versions_out_of_bounds([[3], [2, 3], [4]], served=3, oldest_allowed=3) == [1, 2]
    # Async, two behind allowed: a partial sample continued across versions is fine; three behind is not.
    assert versions_out_of_bounds([[1, 2, 3], [0, 3]], served=3, oldest_allowed=1) == [1]
    assert versions_out_of_bounds([[]], served=3, oldest_allowed=3) == []


def test_the_log_prob_gap_is_bounded_only_where_deterministic_mode_promises_it():
    assert not logprob_gap_exceeded(4.8e-7, promised=True)
    assert not logprob_gap_exceeded(LOGPROB_GAP_BOUND, promised=True)
    assert logprob_gap_exceeded(0.19, promised=True)
    assert logprob_gap_exceeded(math.nan, promised=True)
    assert not logprob_gap_exceeded(None, promised=True)  # not measured (SFT)
    assert not logprob_gap_exceeded(0.19, promised=False)


def test_only_deterministic_cpu_engines_and_an_fp32_trainer_promise_equal_log_probs():
    assert spec().promises_equal_logprobs
    assert not spec(rollout={"deterministic": False}).promises_equal_logprobs
    assert not spec(trainer={"global_batch_size": 16, "micro_batch_size": 16, "dtype": "bf16"}).promises_equal_logprobs


def test_a_rollout_with_tokens_of_other_weights_is_reported_and_fails_the_check(tmp_path):
    made = orchestrator(spec(), tmp_path)
    commit(made, tmp_path, 0)
    # Rollout 1's engines answer with weights 7: not the version the rollout was generated with.
    made.engine_version = 1
    made.sampler.generator.router.version = 7
    batch, meta = asyncio.run(made.generate_rollout(1, weights_wait=0.0, load_time=0.0))
    write_rollout(tmp_path, 1, batch, meta)

    kinds = [kind for kind, _ in made.progress.events]
    assert kinds.count("weight_version_mismatch") == 1
    fields = dict(made.progress.events)["weight_version_mismatch"]
    assert fields["rollout"] == 1 and fields["samples"][0] == [0, [7]]
    events = [{"kind": kind, **fields} for kind, fields in made.progress.events]
    check = check_segment_versions(tmp_path, made.spec, events)
    assert not check.held and "(1, 0, [7])" in check.detail
    assert check_segment_versions(tmp_path, made.spec, []).held is False  # the log alone shows it too


def test_a_committed_run_on_its_own_weights_holds_and_a_gap_is_reported_and_fails(tmp_path):
    made = orchestrator(spec(), tmp_path)
    for rollout_id in range(2):
        commit(made, tmp_path, rollout_id)
    assert check_segment_versions(tmp_path, made.spec, []).held

    # The trainers report rollout 1 with a gap of 1.02: a token that was not the trained policy's.
    for rollout_id, gap in enumerate([4.8e-7, 1.02]):
        trained = {"train/logprob_abs_diff_max": gap}
        layout.train_metrics_path(tmp_path, rollout_id).parent.mkdir(parents=True, exist_ok=True)
        layout.train_metrics_path(tmp_path, rollout_id).write_bytes(orjson.dumps(trained))
        asyncio.run(made.record_trained(rollout_id))
    assert [fields["rollout"] for kind, fields in made.progress.events if kind == "logprob_gap_exceeded"] == [1]
    check = check_logprob_gap(tmp_path, made.spec, [])
    assert not check.held and "(1, 1.02)" in check.detail

    lines = layout.read_lines(layout.metrics_lines_path(tmp_path))
    lines[1]["train/logprob_abs_diff_max"] = 9.5e-7
    layout.metrics_lines_path(tmp_path).write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    assert check_logprob_gap(tmp_path, made.spec, []).held
    assert not check_logprob_gap(tmp_path, made.spec, [{"kind": "logprob_gap_exceeded", "rollout": 1}]).held
