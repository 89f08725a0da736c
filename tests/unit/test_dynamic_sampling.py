"""Dynamic sampling: the filter keeps every rollout full, the buffer carries what is left over (and
survives a restart through its JSON), unscorable groups are dropped and counted, and a budget that
runs out gives up with its reason. Generation is a fake router (a seeded digit per request)."""

from __future__ import annotations

import asyncio
import re
import random

import pytest

from elastic_rl.config import validate_spec
from elastic_rl.errors import EngineError, GaveUp, SpecError
from elastic_rl.rollout import generation
from elastic_rl.rollout.generation import Serving
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.groups import Group, GroupBuffer, Sample, SampleStatus, Segment, to_batch
from elastic_rl.rollout.sampler import DropReason, GroupSampler
from policies.dynamic_sampling import ConsecutiveFailures, zero_std
from policies.exits import EXIT_GAVE_UP, ExitAction, ExitFacts, decide_exit
from policies.restart import RestartPolicy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def spec(**rollout):
    return validate_spec({
        "name": "t",
        "data": {"task": "toy_copy", "num_prompts": 64},
        "rollout": {"prompts_per_rollout": 4, "n_samples_per_prompt": 4, "max_new_tokens": 1, "deterministic": True,
                    **rollout},
        "trainer": {"global_batch_size": 16, "micro_batch_size": 16},
    })  # fmt: skip


class FakeRouter:
    """A fake of the router: each request answers one digit drawn from its sampling seed."""

    def __init__(self, tokenizer, version: int = 0):
        self.digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
        self.version = version
        self.requests = 0

    async def generate(self, ids, params):
        self.requests += 1
        token = random.Random(params["sampling_seed"]).choice(self.digits)
        return {
            "output_ids": [token],
            "meta_info": {
                "output_token_logprobs": [[-2.3, token, None]],
                "weight_version": str(self.version),
                "finish_reason": {"type": "length"},
                "completion_tokens": 1,
                "e2e_latency": 0.01,
            },
        }


def sampler(job) -> tuple[GroupSampler, FakeRouter]:
    tokenizer = load_tokenizer(job.model)
    router = FakeRouter(tokenizer)
    return GroupSampler(job, tokenizer, router), router


def group(index: int, rewards: list[float | None], version: int = 0) -> Group:
    samples = [Sample([5], [-1.0], [Segment(version, 1)], SampleStatus.COMPLETED, reward) for reward in rewards]
    return Group(Prompt(index, 0, f"{index}=", str(index)), [1, 2], samples)


def test_zero_std_and_the_failure_budget():
    assert not zero_std([0.0, 0.0]) and zero_std([0.0, 1.0])
    budget = ConsecutiveFailures(3)
    assert [budget.record(failed) for failed in (True, True, False, True, True, True)] == [
        False, False, False, False, False, True]  # fmt: skip


def test_the_buffer_takes_drops_and_round_trips():
    buffer = GroupBuffer([group(i, [1.0, 0.0], version=i) for i in range(4)])
    assert [g.prompt.index for g in buffer.drop_older_than(1)] == [0]
    restored = GroupBuffer.from_json(buffer.to_json())
    assert [g.prompt.index for g in restored.take(2, lambda groups, count: [2, 0])] == [3, 1]
    assert [g.prompt.index for g in restored.groups] == [2]
    with pytest.raises(ValueError, match="buffer_filter picked"):
        restored.take(1, lambda groups, count: [5])


def test_a_batch_keeps_each_groups_samples_together():
    batch = to_batch([group(7, [1.0, 0.0]), group(9, [0.5, 0.5])], pad_id=0)
    assert batch.prompt_indices.tolist() == [7, 7, 9, 9]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert batch.loss_mask[0].tolist() == [0.0, 0.0, 1.0]


def test_the_filter_keeps_every_rollout_full_and_the_leftovers_wait_in_the_buffer():
    job = spec(dynamic_filter="zero_std", over_sampling_batch_size=8)
    groups_sampler, router = sampler(job)
    for rollout_id in range(3):
        filled = asyncio.run(groups_sampler.fill(rollout_id))
        assert len(filled.groups) == 4 and all(zero_std(g.rewards) for g in filled.groups)
        dropped = [g for g, reason in filled.dropped if reason is DropReason.FILTERED]
        assert all(not zero_std(g.rewards) for g in dropped)
        used = filled.metrics["rollout/samples_used"]
        assert used == 16 and filled.metrics["rollout/samples_generated"] == 4 * 8 * filled.metrics["rollout/generation_rounds"]
    # Nothing generated is lost: every drawn prompt is trained, dropped or buffered (checked over a restart).
    state = groups_sampler.state_dict()
    restarted, _ = sampler(job)
    restarted.load_state_dict(state["data"], state["buffer"])
    assert [g.to_json() for g in restarted.buffer.groups] == [g.to_json() for g in groups_sampler.buffer.groups]
    again = asyncio.run(restarted.fill(3))
    same = asyncio.run(groups_sampler.fill(3))
    assert [g.to_json() for g in again.groups] == [g.to_json() for g in same.groups]


def test_stale_buffered_groups_are_dropped_with_their_reason():
    job = spec(over_sampling_batch_size=8)  # sync: a leftover group may lag one version (max_staleness 1)
    groups_sampler, _ = sampler(job)
    groups_sampler.buffer.add([group(60, [1.0, 0.0, 0.0, 0.0], version=0), group(61, [1.0, 0.0, 0.0, 0.0], version=2)])
    filled = asyncio.run(groups_sampler.fill(2))
    assert [(g.prompt.index, reason) for g, reason in filled.dropped] == [(60, DropReason.STALE)]
    assert filled.groups[0].prompt.index == 61


def test_unscorable_groups_are_skipped_and_a_spent_budget_gives_up(monkeypatch):
    job = spec(max_consecutive_bad_samples=8)
    groups_sampler, _ = sampler(job)
    calls = iter(range(10_000))

    def reward_that_fails_every_fifth(prompt, response, label):
        if next(calls) % 5 == 0:
            raise ValueError("no answer")
        return 1.0 if response == label else 0.0

    groups_sampler.scorer.rule = reward_that_fails_every_fifth
    filled = asyncio.run(groups_sampler.fill(0))
    unscorable = [g for g, reason in filled.dropped if reason is DropReason.UNSCORABLE]
    assert len(filled.groups) == 4 and unscorable and all(not g.scored for g in unscorable)
    assert filled.metrics["rollout/unscorable_samples"] == len(filled.errors) > 0
    assert "ValueError: no answer" in filled.errors[0]

    groups_sampler.scorer.rule = lambda prompt, response, label: float("nan")
    with pytest.raises(GaveUp, match="8 samples in a row could not be scored"):
        asyncio.run(groups_sampler.fill(1))


class FailingRouter(FakeRouter):
    """The fake router, whose first ``failures`` requests fail as an unreachable router's would."""

    def __init__(self, tokenizer, failures: int):
        super().__init__(tokenizer)
        self.failures = failures

    async def generate(self, ids, params):
        if self.failures:
            self.failures -= 1
            raise EngineError("POST http://127.0.0.1:1/generate failed after 16 attempts: connection refused")
        return await super().generate(ids, params)


def test_failed_requests_are_sent_again_until_their_budget_runs_out(monkeypatch):
    monkeypatch.setattr(generation, "REQUEST_BACKOFF_S", 0.001)
    job = spec(max_request_failures=3)
    tokenizer = load_tokenizer(job.model)
    flaky = GroupSampler(job, tokenizer, FailingRouter(tokenizer, failures=5))
    filled = asyncio.run(flaky.fill(0))
    assert len(filled.groups) == 4 and filled.metrics["rollout/failed_requests"] == 5
    assert filled.metrics["rollout/samples_generated"] == 16  # nothing dropped: every request answered in the end

    down = GroupSampler(job, tokenizer, FailingRouter(tokenizer, failures=10_000))
    with pytest.raises(GaveUp, match=r"failed 3 times in a row \(rollout.max_request_failures\); the last: POST"):
        asyncio.run(down.fill(0))


def test_a_filter_that_keeps_nothing_gives_up():
    job = spec(dynamic_filter="tests.unit.test_dynamic_sampling:keep_nothing", max_filtered_rounds=3)
    groups_sampler, router = sampler(job)
    with pytest.raises(GaveUp, match="3 generation rounds in a row kept no group"):
        asyncio.run(groups_sampler.fill(0))
    assert router.requests == 3 * 4 * 4


def keep_nothing(group: Group) -> bool:
    return False


def test_the_orchestrator_giving_up_fails_the_job_with_its_reason():
    facts = ExitFacts("orchestrator", EXIT_GAVE_UP, False, False, (), 0.0, given_up="8 samples in a row could not be scored")
    decision = decide_exit(facts, RestartPolicy(max_restarts=3, window_s=60))
    assert decision.action is ExitAction.FAIL_JOB and "8 samples in a row" in decision.reason


@pytest.mark.parametrize(
    ("rollout", "field"),
    [
        ({"over_sampling_batch_size": 2}, "over_sampling_batch_size (2) is below prompts_per_rollout"),
        ({"dynamic_filter": "zero_std", "n_samples_per_prompt": 1}, "zero_std drops every group of one sample"),
        ({"dynamic_filter": "median"}, "unknown filter 'median'"),
        ({"buffer_filter": "lifo"}, "unknown filter 'lifo'"),
    ],
)
def test_bad_sampling_options_are_named(rollout, field):
    with pytest.raises(SpecError, match=re.escape(field)):
        spec(**rollout)


def test_async_generates_exactly_max_staleness_versions_behind():
    assert [spec().rollout.generating_version(r) for r in range(4)] == [0, 1, 2, 3]
    assert [spec(mode="async", max_staleness=2).rollout.generating_version(r) for r in range(4)] == [0, 0, 0, 1]
    with pytest.raises(SpecError, match="mode async .* set max_staleness >= 1"):
        spec(mode="async", max_staleness=0)


def filter_that_raises(group: Group) -> bool:
    raise KeyError("score")


def buffer_filter_out_of_range(groups: list[Group], count: int) -> list[int]:
    return [len(groups) + 5]


def test_a_users_filter_that_fails_gives_up_with_its_name():
    raising = spec(dynamic_filter="tests.unit.test_dynamic_sampling:filter_that_raises")
    with pytest.raises(GaveUp, match="rollout.dynamic_filter .*filter_that_raises raised KeyError"):
        asyncio.run(sampler(raising)[0].fill(0))
    out_of_range = spec(buffer_filter="tests.unit.test_dynamic_sampling:buffer_filter_out_of_range")
    groups_sampler, _ = sampler(out_of_range)
    groups_sampler.buffer.add([group(60, [1.0, 0.0, 0.0, 0.0])])
    with pytest.raises(GaveUp, match=r"rollout.buffer_filter .* failed: ValueError: .*picked \[6\] from 1"):
        asyncio.run(groups_sampler.fill(0))


def test_an_answer_from_other_weights_realigns_the_engines_and_is_asked_again():
    job = spec()
    groups_sampler, router = sampler(job)
    router.version = 7  # a replacement engine registered on the newest weights
    realigned = []

    async def realign():
        realigned.append(True)
        router.version = 3

    groups_sampler.generator.serving = Serving(3, realign)
    filled = asyncio.run(groups_sampler.fill(3))
    assert realigned and all(sample.version == 3 for group in filled.groups for sample in group.samples)
    assert filled.metrics["rollout/failed_requests"] > 0
