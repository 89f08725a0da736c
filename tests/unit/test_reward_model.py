"""The reward model's client (rollout.reward_model) against a real HTTP server on loopback: rewards as
numbers, dicts and batches; what the model answers about a sample (a refusal, a body that is not JSON,
a value that is not a number) makes that sample unscorable; a model that does not answer is waited for,
each failure counted, and fails the job with the reason once its budget is spent."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from elastic_rl.errors import GaveUp
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.rollout import reward_model
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.groups import Sample, SampleStatus, Segment
from elastic_rl.rollout.scoring import Scorer
from elastic_rl.spec.model import ModelSpec
from elastic_rl.spec.rollout import RolloutSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PROMPT = Prompt(4, 0, "4=", "4")


class FakeRewardModel:
    """A reward-model server (a test double of one, on a real socket): its answer for each request is
    set by ``mode``; the first ``down_for`` requests get 503."""

    def __init__(self, mode: str = "number", down_for: int = 0):
        self.mode, self.down_for, self.requests, self.bodies = mode, down_for, 0, []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self.requests <= self.down_for:
            if self.mode == "slow":  # past the client's timeout
                await asyncio.sleep(1.0)
            return web.Response(status=503, text="loading")
        body = await request.json()
        self.bodies.append(body)
        samples = body if isinstance(body, list) else [body]
        score = [float(sample["response"].startswith(sample["label"])) for sample in samples]
        if self.mode == "refuse":
            return web.Response(status=400, text="no label")
        if self.mode == "garbage":
            return web.Response(text="<html>")
        if self.mode == "dict":
            score = [{"score": value, "length": len(s["response"])} for value, s in zip(score, samples)]
        if self.mode == "nan":
            score = ["NaN" for _ in score]
        return web.json_response(score if isinstance(body, list) else score[0])


@contextlib.asynccontextmanager
async def serving(model: FakeRewardModel):
    app = web.Application()
    app.router.add_post("/", model.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/"
    finally:
        await runner.cleanup()


def scored(model: FakeRewardModel, **settings) -> tuple[list, Scorer]:
    tokenizer = load_tokenizer(ModelSpec())
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "4445"]
    samples = [Sample(digits[i : i + 1], [-0.1], [Segment(0, 1)], SampleStatus.COMPLETED) for i in range(4)]

    async def run():
        async with serving(model) as url:
            scorer = Scorer(RolloutSpec(reward_model={"url": url, **settings}), tokenizer)
            return await scorer.score(PROMPT, samples), scorer

    return asyncio.run(run())


@pytest.fixture(autouse=True)
def short_backoff(monkeypatch):
    monkeypatch.setattr(reward_model, "FIRST_BACKOFF_S", 0.01)


def test_numbers_dicts_and_batches_are_rewards():
    model = FakeRewardModel()
    assert scored(model)[0] == [(1.0, None)] * 3 + [(0.0, None)]
    assert model.bodies[0] == {"prompt": "4=", "response": "4", "label": "4", "metadata": {}}
    assert scored(FakeRewardModel("dict"), reward_key="score")[0] == [(1.0, None)] * 3 + [(0.0, None)]
    batched = FakeRewardModel()
    assert scored(batched, batch_size=3)[0] == [(1.0, None)] * 3 + [(0.0, None)]
    assert [len(body) for body in batched.bodies] == [3, 1]


@pytest.mark.parametrize(
    ("mode", "settings", "why"),
    [
        ("refuse", {}, "the reward model refused it: HTTP 400"),
        ("garbage", {}, "the reward model's answer is not JSON"),
        ("nan", {}, "the reward is nan"),
        ("dict", {}, "set rollout.reward_model.reward_key"),
        ("dict", {"reward_key": "other"}, "the reward's dict has no 'other' (rollout.reward_model.reward_key)"),
    ],
)
def test_what_the_model_answers_about_a_sample_is_bad_data(mode, settings, why):
    results, scorer = scored(FakeRewardModel(mode), **settings)
    assert all(reward is None and why in reason and reason.startswith("prompt 4:") for reward, reason in results)
    assert scorer.reward_model_failures == 0


def test_a_model_that_does_not_answer_is_waited_for_and_counted():
    results, scorer = scored(FakeRewardModel(down_for=3), batch_size=4)
    assert results == [(1.0, None)] * 3 + [(0.0, None)]
    assert scorer.reward_model_failures == 3
    slow, scorer = scored(FakeRewardModel("slow", down_for=1), batch_size=4, timeout_s=0.3)
    assert slow == results and scorer.reward_model_failures == 1
    scorer.count_from_zero()
    assert scorer.reward_model_failures == 0


def test_a_model_down_past_its_budget_fails_the_job_with_the_reason():
    with pytest.raises(GaveUp, match=r"failed 2 times in a row \(rollout.reward_model.max_failures\).*HTTP 503"):
        scored(FakeRewardModel(down_for=100), max_failures=2, batch_size=4)
