"""A user's whole-rollout function: the multi-turn example (examples/multi_turn_rollout.py) fills a rollout
whose loss masks cover only the model's tokens; a malformed return is refused naming the sample and the
field; a function that fails is called again for the same prompts, counted, and fails the job once its
budget is spent; rewards the function gives are used, and checked as any reward; the spec refuses the
fields a rollout function makes meaningless. Generation is the fake router of the dynamic-sampling tests
(a request answers max_new_tokens copies of a digit drawn from its seed)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re

import pytest

from elastic_rl.errors import GaveUp, SpecError
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.rollout import rollout_function
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.groups import SampleStatus, to_batch
from elastic_rl.rollout.rollout_function import (
    MalformedReturn,
    RolloutFunction,
    RolloutInput,
    RolloutPrompt,
    RolloutSample,
    checked_samples,
)
from elastic_rl.rollout.sampler import DropReason, GroupSampler
from elastic_rl.spec.loading import validate_spec
from tests.rewards import fake_digit_share
from tests.unit.test_dynamic_sampling import FakeRouter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

EXAMPLE = "examples.multi_turn_rollout:rollout"
HERE = "tests.unit.test_rollout_function"
VERSION = 3


def spec(**rollout):
    return validate_spec(
        {
            "name": "t",
            "data": {"task": "toy_copy", "num_prompts": 64},
            "rollout": {
                "prompts_per_rollout": 4,
                "n_samples_per_prompt": 2,
                "max_new_tokens": 30,
                "deterministic": True,
                "reward": "tests.rewards:fake_digit_share",
                **rollout,
            },
            "trainer": {"global_batch_size": 8, "micro_batch_size": 8},
        }
    )


def filling(job) -> tuple[RolloutFunction, FakeRouter]:
    tokenizer = load_tokenizer(job.model)
    router = FakeRouter(tokenizer, version=VERSION)
    return RolloutFunction(job, GroupSampler(job, tokenizer, router)), router


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(rollout_function, "FIRST_BACKOFF_S", 0.001)


def test_the_multi_turn_examples_loss_mask_covers_only_the_models_tokens():
    filler, router = filling(spec(rollout_function=EXAMPLE))
    filled = asyncio.run(filler.fill(0, VERSION))
    assert len(filled.groups) == 4 and filled.metrics["rollout/rollout_function_failures"] == 0
    tokenizer = load_tokenizer(spec().model)
    batch = to_batch(filled.groups, pad_id=0)
    samples = [sample for group in filled.groups for sample in group.samples]
    # The fake writes every turn to its length, so the calculator answers after each turn but the last.
    assert router.requests == sum(sample.metadata["turns"] for sample in samples)
    for row, sample in enumerate(samples):
        calls = sample.metadata["tool_calls"]
        assert calls and sample.metadata["turns"] == 1 + len(calls)
        start = int(batch.prompt_lengths[row])
        tool = {start + t for call in calls for t in range(call["start"], call["end"])}
        for call in calls:
            assert tokenizer.decode(sample.output_ids[call["start"] : call["end"]]) == call["answer"]
        end = start + len(sample.output_ids)
        assert batch.loss_mask[row].tolist() == [
            1.0 if start <= t < end and t not in tool else 0.0 for t in range(batch.tokens.shape[1])
        ]
        assert all(batch.engine_logprobs[row, t] == 0.0 for t in tool)
        assert sample.status is SampleStatus.TRUNCATED and sample.version == VERSION
        assert sample.reward == fake_digit_share("", tokenizer.decode(sample.output_ids, skip_special_tokens=True), "")
    # The same prompts and seeds make the same rollout.
    again = asyncio.run(filling(spec(rollout_function=EXAMPLE))[0].fill(0, VERSION))
    assert [s.output_ids for g in again.groups for s in g.samples] == [s.output_ids for s in samples]


def given(prompts: int = 2, n: int = 2) -> RolloutInput:
    tokenizer = load_tokenizer(spec().model)
    return RolloutInput(
        0, [RolloutPrompt(i, Prompt(10 + i, 0, f"{i}=", str(i)), [1, 2]) for i in range(prompts)], n, 8, tokenizer
    )


def good(prompt: int, **changes) -> RolloutSample:
    return dataclasses.replace(RolloutSample(prompt, [5, 6], [1, 0], [-0.5, 0.0], VERSION), **changes)


@pytest.mark.parametrize(
    ("returned", "named"),
    [
        ("not a list", "returned str, not a list"),
        ([good(0), good(0), good(1), {"prompt": 1}], "sample 3 is a dict"),
        ([good(0), good(0), good(1), good(2)], "sample 3: prompt is 2"),
        ([good(0), good(0, logprobs=[-1.0]), good(1), good(1)], "sample 1: output_ids, loss_mask and logprobs differ"),
        ([good(0), good(0, loss_mask=[1, 2]), good(1), good(1)], "sample 1: loss_mask"),
        ([good(0), good(0), good(1, logprobs=[math.nan, 0.0]), good(1)], "sample 2: logprobs"),
        ([good(0), good(0), good(1, output_ids=[5, 10**9]), good(1)], "sample 2: output_ids[1] is 1000000000 (int)"),
        ([good(0), good(0), good(1, output_ids=None), good(1)], "sample 2: output_ids is a NoneType, not a list"),
        ([good(0), good(0), good(1, output_ids=[5] * 9, loss_mask=[1] * 9, logprobs=[0.0] * 9), good(1)], "over max"),
        ([good(0), good(0), good(1), good(1, weight_version=VERSION - 2)], "sample 3: weight_version is 1, outside"),
        (
            [good(0, weight_version=VERSION - 1), good(0), good(1), good(1)],
            "sample 0: weight_version is 2, but no engine",
        ),
        ([good(0), good(0, status="done"), good(1), good(1)], "sample 1: status"),
        ([good(0), good(0), good(1), good(1, metadata={"x": object()})], "sample 3: metadata"),
        ([good(0), good(0), good(1)], "prompt 1 (data index 11) has 1 samples"),
        (
            [good(0), good(0, reward=1.0), good(1), good(1)],
            "prompt 0 (data index 10): 1 of its 2 samples have a reward",
        ),
    ],
)
def test_a_malformed_return_is_refused_naming_the_sample_and_the_field(returned, named):
    with pytest.raises(MalformedReturn, match=re.escape(named)):
        checked_samples(returned, given(), 100, range(VERSION - 1, VERSION + 1), answered={VERSION})


def test_a_well_formed_return_passes_grouped_by_prompt():
    samples = [good(1), good(0), good(0, error="the tool timed out", weight_version=0), good(1)]
    by_prompt = checked_samples(samples, given(), 100, range(VERSION, VERSION + 1), answered={VERSION})
    assert by_prompt == [[samples[1], samples[2]], [samples[0], samples[3]]]


CALLS = {"count": 0}


def fails_twice(given: RolloutInput, engine) -> list[RolloutSample]:
    """A sync rollout function (it runs in a thread, and calls the engine blocking) that raises twice, then
    returns a malformed list once, then works."""
    CALLS["count"] += 1
    if CALLS["count"] <= 2:
        raise ConnectionError("the environment server is restarting")
    answer = engine.generate_blocking(given.prompts[0].prompt_ids, given.sampling_params(0, 0))
    version = int(answer["meta_info"]["weight_version"])
    samples = [
        RolloutSample(p.number, [5], [1], [-0.1], version, reward=float(s)) for p in given.prompts for s in (0, 1)
    ]
    return samples[:-1] if CALLS["count"] == 3 else samples


def always_fails(given: RolloutInput, engine):
    raise RuntimeError("the environment is gone")


async def claims_older_weights(given: RolloutInput, engine) -> list[RolloutSample]:
    """Makes its samples with the engine, then claims the weights before those that answered."""
    answer = await engine.generate(given.prompts[0].prompt_ids, given.sampling_params(0, 0))
    older = int(answer["meta_info"]["weight_version"]) - 1
    return [RolloutSample(p.number, [5], [1], [-0.1], older) for p in given.prompts for _ in range(2)]


async def engines_given_up_inside_a_task_group(given: RolloutInput, engine):
    """The engines' failure budget runs out in one of the function's tasks."""

    async def request() -> None:
        raise GaveUp("a generation request failed 8 times in a row (rollout.max_request_failures)")

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(request())


POISONED: set[int] = set()


async def gives_nan_rewards_to_its_first_prompt(given: RolloutInput, engine) -> list[RolloutSample]:
    """Scores its own samples; the group of the first prompt it is ever given gets a reward that is not a
    number (bad data)."""
    if not POISONED:
        POISONED.add(given.prompts[0].prompt.index)
    answer = await engine.generate(given.prompts[0].prompt_ids, given.sampling_params(0, 0))
    version = int(answer["meta_info"]["weight_version"])
    return [
        RolloutSample(p.number, [5], [1], [-0.1], version, reward=math.nan if p.prompt.index in POISONED else 0.5 * s)
        for p in given.prompts
        for s in range(given.n_samples_per_prompt)
    ]


def test_a_failing_function_is_called_again_for_the_same_prompts_and_counted():
    CALLS["count"] = 0
    filler, _ = filling(spec(rollout_function=f"{HERE}:fails_twice"))
    filled = asyncio.run(filler.fill(0, VERSION))
    assert CALLS["count"] == 4 and filled.metrics["rollout/rollout_function_failures"] == 3
    assert len(filled.function_failures) == 3 and "ConnectionError" in filled.function_failures[0]
    assert "malformed: prompt 3" in filled.function_failures[2]
    assert len(filled.drawn) == 4  # one draw: the calls after a failure got the same prompts
    assert [s.reward for g in filled.groups for s in g.samples] == [0.0, 1.0] * 4  # the function's rewards


def test_a_function_that_keeps_failing_fails_the_job_with_the_last_reason():
    filler, _ = filling(spec(rollout_function=f"{HERE}:always_fails", max_rollout_function_failures=3))
    with pytest.raises(GaveUp, match="failed 3 times in a row .*RuntimeError: the environment is gone"):
        asyncio.run(filler.fill(0, VERSION))


def test_samples_from_weights_older_than_the_staleness_bound_are_refused():
    # Sync mode without a buffer: a rollout trains only the weights that generate it.
    filler, _ = filling(spec(rollout_function=f"{HERE}:claims_older_weights", max_rollout_function_failures=2))
    with pytest.raises(GaveUp, match=r"weight_version is 2, outside the versions this rollout may train on \(3 to 3"):
        asyncio.run(filler.fill(5, VERSION))


def test_the_engines_giving_up_inside_the_function_is_not_the_functions_failure():
    filler, _ = filling(spec(rollout_function=f"{HERE}:engines_given_up_inside_a_task_group"))
    with pytest.raises(GaveUp, match="max_request_failures") as raised:
        asyncio.run(filler.fill(0, VERSION))
    assert "rollout_function" not in str(raised.value)  # given up at once, not called again


def test_a_reward_that_is_not_a_number_skips_its_group_and_a_fresh_prompt_takes_its_place():
    POISONED.clear()
    filler, _ = filling(spec(rollout_function=f"{HERE}:gives_nan_rewards_to_its_first_prompt"))
    filled = asyncio.run(filler.fill(0, VERSION))
    unscorable = [group.prompt.index for group, reason in filled.dropped if reason is DropReason.UNSCORABLE]
    assert unscorable == sorted(POISONED) and unscorable[0] not in {g.prompt.index for g in filled.groups}
    assert len(filled.groups) == 4 and len(filled.drawn) == 5
    assert filled.metrics["rollout/generation_rounds"] == 2 and filled.metrics["rollout/unscorable_samples"] == 2


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"generate_function": "examples.calculator_tool:generate"}, "rollout.generate_function"),
        ({"partial_rollout": True}, "rollout.partial_rollout"),
        ({"over_sampling_batch_size": 8}, "rollout.over_sampling_batch_size"),
        ({"dynamic_filter": "zero_std"}, "rollout.dynamic_filter"),
        ({"buffer_filter": "my:pick"}, "rollout.buffer_filter"),
    ],
)
def test_the_spec_refuses_what_a_rollout_function_makes_meaningless(fields, named):
    with pytest.raises(SpecError, match=f"rollout.rollout_function cannot be combined with {named}"):
        spec(rollout_function=EXAMPLE, **fields)


@pytest.mark.parametrize(
    ("field", "named"),
    [
        ({"reward_function": "tests.rewards:anything"}, "with rollout.reward_function"),
        ({"group_reward_function": "tests.rewards:anything"}, "with rollout.group_reward_function"),
        ({"reward_key": "score"}, "with rollout.reward_key: set rollout.reward_model.reward_key instead"),
    ],
)
def test_the_spec_refuses_a_reward_function_beside_a_reward_model(field, named):
    with pytest.raises(SpecError, match=f"rollout.reward_model cannot be combined {named}"):
        spec(reward_model={"url": "http://127.0.0.1:9/"}, **field)
