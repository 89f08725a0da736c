"""The orchestrator's state in the rollout log: what it commits with a rollout and restores on a
restart (the bad-data count included), and what it reports (stale groups). Generation is the fake
router of test_dynamic_sampling."""

from __future__ import annotations

import asyncio

import pytest

from checkpoints.rollout_log import write_rollout
from elastic_rl.config import validate_spec
from elastic_rl.errors import GaveUp
from elastic_rl.jobenv import JobEnv
from elastic_rl.rollout.orchestrator import Orchestrator
from elastic_rl.rollout.progress import ProgressReporter
from tests.unit.test_dynamic_sampling import FakeRouter, group

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def spec(**fields):
    rollout = {"prompts_per_rollout": 4, "n_samples_per_prompt": 4, "max_new_tokens": 1, "deterministic": True,
               "num_rollouts": 2, **fields.pop("rollout", {})}  # fmt: skip
    return validate_spec({
        "name": "t",
        "data": {"task": "toy_copy", "num_prompts": 64},
        "rollout": rollout,
        "trainer": {"global_batch_size": 16, "micro_batch_size": 16},
        **fields,
    })  # fmt: skip


class RecordingProgress(ProgressReporter):
    """The orchestrator's progress reporter outside erld, keeping the events it is given."""

    def __init__(self, workdir):
        super().__init__("t", None, workdir)
        self.events: list[tuple[str, dict]] = []

    async def event(self, kind, message, **fields):
        self.events.append((kind, fields))


def orchestrator(job, workdir) -> Orchestrator:
    made = Orchestrator(JobEnv("t", workdir, job), None, RecordingProgress(workdir), None)
    made.sampler.generator.router = FakeRouter(made.tokenizer)
    return made


def commit(made: Orchestrator, workdir, rollout_id: int) -> dict:
    """Generate a rollout in sync mode, as if the engines had loaded its weights, and commit it."""
    made.engine_version = made.sampler.generator.router.version = rollout_id
    batch, meta = asyncio.run(made.generate_rollout(rollout_id, load_time=0.0))
    write_rollout(workdir, rollout_id, batch, meta)
    return meta


def test_the_bad_data_count_is_committed_and_restored(tmp_path):
    job = spec(rollout={"max_consecutive_bad_samples": 8, "over_sampling_batch_size": 8})
    first = orchestrator(job, tmp_path)
    calls = iter(range(10_000))
    toy_copy = first.sampler.scorer.rule
    # The last of the round's 32 samples cannot be scored: the rollout ends one bad sample into a row.
    first.sampler.scorer.rule = lambda *args: float("nan") if next(calls) == 31 else toy_copy(*args)
    assert commit(first, tmp_path, 0)["bad_samples_in_a_row"] == 1

    restarted = orchestrator(job, tmp_path)
    assert restarted.resume_point() == 1
    assert restarted.sampler.bad_data.count == 1
    restarted.sampler.scorer.rule = lambda *args: float("nan")
    with pytest.raises(GaveUp, match="8 samples in a row could not be scored"):
        asyncio.run(restarted.sampler.fill(1))
    assert restarted.sampler.bad_data.count == 8  # 7 more after the restart, not 8


def test_stale_groups_are_counted_and_reported(tmp_path):
    made = orchestrator(spec(rollout={"over_sampling_batch_size": 8}), tmp_path)
    made.sampler.buffer.add([group(60, [1.0, 0.0, 0.0, 0.0], version=0)])
    _, filled = asyncio.run(made.fill(2))
    assert filled.metrics["rollout/stale_groups"] == 1
    assert made.progress.events == [("stale_groups_dropped", {"rollout": 2, "prompts": [[60, 0]]})]
