"""Partial rollout: once a rollout is full the requests still out are aborted, their groups wait in
the buffer with the tokens made so far, and the next rollout generates them on, each segment keeping
its log probs and weight version; across rollouts every group is trained, dropped or buffered once.
Generation is a fake router whose requests make one token per tick and stop when aborted. Aborts go
to every engine at once, one attempt each; a round that raises leaves no request generating; outside
partial rollout an engine's abort ends its sample, which is trained as it is."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from elastic_rl.engines import router as router_module
from elastic_rl.engines.router import RouterClient
from elastic_rl.errors import EngineError, GaveUp, SpecError
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.groups import Group, Sample, SampleStatus, Segment
from elastic_rl.rollout.sampler import GroupSampler
from elastic_rl.spec.loading import validate_spec
from tests.unit.fake_router import StreamsWholeAnswers

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

MAX_NEW_TOKENS = 12


def spec(**rollout):
    return validate_spec(
        {
            "name": "t",
            "data": {"task": "toy_copy", "num_prompts": 64},
            "rollout": {
                "prompts_per_rollout": 4,
                "n_samples_per_prompt": 2,
                "max_new_tokens": MAX_NEW_TOKENS,
                "deterministic": True,
                "over_sampling_batch_size": 8,
                "partial_rollout": True,
                **rollout,
            },
            "trainer": {"global_batch_size": 8, "micro_batch_size": 8},
        }
    )


class FakeStreamingRouter(StreamsWholeAnswers):
    """A fake of the router: a request makes one token per tick, up to a length drawn from its seed,
    and ends early with finish reason abort when aborted."""

    def __init__(self, tokenizer):
        self.token = tokenizer.convert_tokens_to_ids("1")
        self.version = 0
        self.aborts = 0
        self.inputs: list[list[int]] = []

    async def generate(self, ids, params):
        self.inputs.append(list(ids))
        length = min(random.Random(params["sampling_seed"]).randint(1, MAX_NEW_TOKENS), params["max_new_tokens"])
        version, output, reason = self.version, [], "length"
        aborts_before = self.aborts
        while len(output) < length:
            if self.aborts != aborts_before:  # aborted while held
                reason = "abort"
                break
            await asyncio.sleep(0.002)
            output.append(self.token)
        return {
            "output_ids": output,
            "meta_info": {
                "output_token_logprobs": [[-0.5 - version, token, None] for token in output],
                "weight_version": str(version),
                "finish_reason": {"type": reason},
                "completion_tokens": len(output),
                "e2e_latency": 0.01,
            },
        }

    async def abort_on_every_worker(self):
        self.aborts += 1
        return []


def fill(sampler: GroupSampler, router: FakeStreamingRouter, rollout_id: int):
    router.version = rollout_id
    return asyncio.run(sampler.fill(rollout_id))


def test_aborted_groups_wait_with_their_tokens_and_are_continued_first():
    job = spec()
    tokenizer = load_tokenizer(job.model)
    router = FakeStreamingRouter(tokenizer)
    sampler = GroupSampler(job, tokenizer, router)

    first = fill(sampler, router, 0)
    assert len(first.groups) == 4 and all(group.finished for group in first.groups)
    assert router.aborts >= 1 and first.metrics["rollout/aborted_samples"] > 0
    unfinished = [group for group in sampler.buffer.groups if not group.finished]
    assert unfinished
    samples = {(g.prompt.index, i): s for g in unfinished for i, s in enumerate(g.samples)}
    started = {key: s for key, s in samples.items() if s.output_ids and s.status is SampleStatus.UNFINISHED}
    done = {key: s for key, s in samples.items() if s.finished}
    assert started and all(s.version == 0 for s in started.values())

    # A restarted orchestrator resumes from the committed state: the same buffer, tokens and all.
    restarted = GroupSampler(job, tokenizer, router)
    state = sampler.state_dict()
    restarted.load_state_dict(state)
    assert restarted.buffer.to_json() == sampler.buffer.to_json()

    router.inputs.clear()
    second = fill(restarted, router, 1)
    assert second.metrics["rollout/continued_groups"] == len(unfinished)
    continued = {(g.prompt.index, i): s for g in second.groups for i, s in enumerate(g.samples)}
    assert started.keys() & continued.keys()  # with their head start, aborted samples finish first
    for key, before in started.items():
        if key in continued:  # generated on from where it stopped: its old tokens and log probs, then the new
            after = continued[key]
            assert after.output_ids[: len(before.output_ids)] == before.output_ids
            assert after.logprobs[: len(before.logprobs)] == before.logprobs
            assert [segment.version for segment in after.segments][0] == 0
            assert sum(segment.tokens for segment in after.segments) == len(after.output_ids)
    for key, before in done.items():  # a sample that had finished is not generated again
        if key in continued:
            assert continued[key].output_ids == before.output_ids and continued[key].segments == before.segments
    resumed_inputs = [ids for ids in router.inputs if len(ids) > 2]  # prompt ids plus tokens made before
    assert resumed_inputs
    assert len({g.prompt.index for g in second.groups}) == 4


@pytest.mark.parametrize(
    "over_sampling, staleness",
    [(8, 1), (12, 2)],  # twice the rollout's prompts at one version of lag, three times at two
)
def test_every_group_is_trained_or_buffered_once_and_no_token_is_lost(over_sampling, staleness):
    job = spec(over_sampling_batch_size=over_sampling, max_staleness=staleness)
    tokenizer = load_tokenizer(job.model)
    router = FakeStreamingRouter(tokenizer)
    sampler = GroupSampler(job, tokenizer, router)
    drawn, accounted, aborted = [], [], 0
    for rollout_id in range(8):
        filled = fill(sampler, router, rollout_id)
        assert len(filled.groups) == 4  # every rollout full
        # A continued group is never aborted again, and the oldest train first: nothing goes stale.
        assert filled.dropped == [] and filled.metrics["rollout/stale_groups"] == 0
        aborted += filled.metrics["rollout/aborted_samples"]
        drawn += [p.index for p in filled.drawn]
        accounted += [g.prompt.index for g in filled.groups]
        assert all(rollout_id - group.oldest_version <= staleness for group in filled.groups)
    accounted += [g.prompt.index for g in sampler.buffer.groups]
    assert aborted > 0
    assert len(drawn) == len(set(drawn))
    assert sorted(accounted) == sorted(drawn)


def finished_group(index: int, version: int) -> Group:
    samples = [Sample([5], [-1.0], [Segment(version, 1)], SampleStatus.COMPLETED, 1.0) for _ in range(2)]
    return Group(Prompt(index, 0, f"{index}=", str(index)), [1, 2], samples)


def test_aborted_groups_are_continued_even_when_the_buffer_alone_fills_the_rollout():
    job = spec(over_sampling_batch_size=12, max_staleness=2)
    tokenizer = load_tokenizer(job.model)
    router = FakeStreamingRouter(tokenizer)
    sampler = GroupSampler(job, tokenizer, router)
    fill(sampler, router, 0)
    unfinished = [group.prompt.index for group in sampler.buffer.groups if not group.finished]
    assert unfinished
    sampler.buffer.groups[:0] = [finished_group(1000 + i, version=0) for i in range(4)]  # first in line

    second = fill(sampler, router, 1)
    assert [group.prompt.index for group in second.groups] == [1000, 1001, 1002, 1003]
    assert second.metrics["rollout/continued_groups"] == len(unfinished)
    assert second.drawn == []  # the rollout was full: no new prompt drawn
    assert not sampler.buffer.holds_unfinished()
    assert set(unfinished) <= {group.prompt.index for group in sampler.buffer.groups}


def test_over_sampling_beyond_what_max_staleness_lets_wait_is_refused():
    with pytest.raises(
        SpecError,
        match=re.escape(
            "over_sampling_batch_size (12) is over (max_staleness + 1) x "
            "prompts_per_rollout (8) with rollout.partial_rollout"
        ),
    ):
        spec(over_sampling_batch_size=12)


def test_partial_rollout_needs_room_for_one_version_of_lag():
    with pytest.raises(SpecError, match="max_staleness >= 1"):
        spec(max_staleness=0)


def test_partial_rollout_and_async_mode_are_refused_together():
    with pytest.raises(SpecError, match=r"rollout.partial_rollout cannot be combined with rollout.mode async"):
        spec(mode="async", max_staleness=2)


class FakeAbortingRouter(FakeStreamingRouter):
    """The fake streaming router, whose engines abort every request on their own after a few tokens."""

    async def generate(self, ids, params):
        result = await super().generate(ids, {**params, "max_new_tokens": 3})
        result["meta_info"]["finish_reason"] = {"type": "abort"}
        return result


def test_outside_partial_rollout_an_engine_abort_ends_its_sample_and_it_is_trained():
    job = spec(partial_rollout=False)
    tokenizer = load_tokenizer(job.model)
    router = FakeAbortingRouter(tokenizer)
    sampler = GroupSampler(job, tokenizer, router)
    filled = fill(sampler, router, 0)
    assert len(filled.groups) == 4
    assert all(sample.status is SampleStatus.ABORTED for group in filled.groups for sample in group.samples)
    assert filled.metrics["rollout/aborted_samples"] == 0 and filled.metrics["rollout/continued_groups"] == 0
    assert all(group.finished for group in sampler.buffer.groups)  # leftovers wait as finished groups


class FakeEngineClient:
    """A fake of one engine's client: its abort takes a while, and fails on the engine named ``dead``."""

    dead = "http://engine-1"
    in_flight = 0
    most_in_flight = 0
    calls: list[tuple[str, int]] = []

    def __init__(self, url, attempts=3, secret=None):
        self.url, self.attempts = url, attempts

    async def abort(self, abort_all=False):
        cls = FakeEngineClient
        cls.calls.append((self.url, self.attempts))
        cls.in_flight += 1
        cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        await asyncio.sleep(0.05)
        cls.in_flight -= 1
        if self.url == cls.dead:
            raise EngineError(f"POST {self.url}/abort_request failed after 1 attempts: connection refused")


def test_aborts_go_to_every_engine_at_once_one_attempt_each(monkeypatch):
    monkeypatch.setattr(router_module, "EngineClient", FakeEngineClient)
    monkeypatch.setattr(FakeEngineClient, "calls", [])
    monkeypatch.setattr(FakeEngineClient, "most_in_flight", 0)
    client = RouterClient("http://router")

    async def worker_urls():
        return {"http://engine-0", "http://engine-1", "http://engine-2"}

    client.worker_urls = worker_urls
    failed = asyncio.run(client.abort_on_every_worker())
    assert FakeEngineClient.most_in_flight == 3
    assert sorted(FakeEngineClient.calls) == [(f"http://engine-{i}", 1) for i in range(3)]  # never retried
    assert len(failed) == 1 and failed[0].startswith("http://engine-1: POST")


class FakeCountingRouter(FakeStreamingRouter):
    """The fake streaming router, counting the requests still generating."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.generating = 0

    async def generate(self, ids, params):
        self.generating += 1
        try:
            return await super().generate(ids, params)
        finally:
            self.generating -= 1


def test_a_round_that_raises_leaves_no_request_generating():
    job = spec(max_consecutive_bad_samples=1)
    tokenizer = load_tokenizer(job.model)
    router = FakeCountingRouter(tokenizer)
    sampler = GroupSampler(job, tokenizer, router)
    sampler.scorer.rule = lambda prompt, response, label: float("nan")  # the first group scored gives up

    async def fill_then_count():
        with pytest.raises(GaveUp):
            await sampler.fill(0)
        return router.generating

    assert asyncio.run(fill_then_count()) == 0
    assert not sampler.generator.full
