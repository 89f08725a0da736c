"""Users' own generate and reward functions: the multi-turn calculator example's loss mask covers
only the model's tokens; a reward function may be async, return a dict (rollout.reward_key) or score
a whole group; whatever such a function gets wrong makes its sample unscorable, counted, and the
rollout still fills. Generation is the fake router of the dynamic-sampling tests (a request answers
max_new_tokens copies of a digit drawn from its seed)."""

from __future__ import annotations

import asyncio

import pytest

from elastic_rl.errors import GaveUp, SpecError
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.generation import Generated
from elastic_rl.rollout.groups import Sample, SampleStatus, Segment, to_batch
from elastic_rl.rollout.sampler import DropReason, GroupSampler
from elastic_rl.rollout.scoring import RewardInput, Scorer
from elastic_rl.spec.loading import validate_spec
from tests.unit.test_dynamic_sampling import FakeRouter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CALCULATOR = "examples.calculator_tool:generate"
HERE = "tests.unit.test_custom_functions"


def spec(**rollout):
    return validate_spec(
        {
            "name": "t",
            "data": {"task": "toy_copy", "num_prompts": 64},
            "rollout": {
                "prompts_per_rollout": 4,
                "n_samples_per_prompt": 2,
                "max_new_tokens": 24,
                "deterministic": True,
                **rollout,
            },
            "trainer": {"global_batch_size": 8, "micro_batch_size": 8},
        }
    )


def filled(job, **attributes):
    tokenizer = load_tokenizer(job.model)
    sampler = GroupSampler(job, tokenizer, FakeRouter(tokenizer, version=3))
    for name, value in attributes.items():
        setattr(sampler.scorer, name, value)
    return asyncio.run(sampler.fill(0)), tokenizer


def test_the_calculator_examples_loss_mask_covers_only_the_models_tokens():
    result, tokenizer = filled(spec(generate_function=CALCULATOR, reward="tests.rewards:fake_digit_share"))
    assert len(result.groups) == 4
    batch = to_batch(result.groups, pad_id=0)
    for row, sample in enumerate(s for group in result.groups for s in group.samples):
        (call,) = sample.metadata["tool_calls"]
        start = int(batch.prompt_lengths[row])
        end = start + len(sample.output_ids)
        tool = range(start + call["start"], start + call["end"])
        # The model wrote 12 digits, the calculator answered their value in brackets, the model wrote on.
        assert tokenizer.decode(batch.tokens[row, tool.start : tool.stop].tolist()) == call["answer"]
        assert call["answer"] == "[" + str(int(tokenizer.decode(sample.output_ids[:12])))[:6] + "]"
        expected = [1.0 if start <= t < end and t not in tool else 0.0 for t in range(batch.tokens.shape[1])]
        assert batch.loss_mask[row].tolist() == expected
        assert all(batch.engine_logprobs[row, t] == 0.0 for t in tool)
        assert sample.status is SampleStatus.TRUNCATED and sample.metadata["turns"] == 2
        assert sample.segments == [Segment(3, 12), Segment(3, len(sample.output_ids) - 12 - len(tool))]
    assert result.metrics["rollout/samples_used"] == 8


async def async_dict_reward(item: RewardInput) -> dict:
    return {"copied": float(item.response.startswith(item.prompt.label)), "length": len(item.sample.output_ids)}


def group_reward_ranks(items: list[RewardInput]) -> list[float]:
    """A fake reward model that compares a group's samples: 1 for the first, 0 for the rest."""
    return [1.0] + [0.0] * (len(items) - 1)


def test_reward_functions_async_by_key_and_by_group():
    tokenizer = load_tokenizer(spec().model)
    prompt = Prompt(3, 0, "1=", "1")
    samples = [
        Sample([5, 5], [-1.0, -1.0], [Segment(0, 2)], SampleStatus.COMPLETED),  # "11"
        Sample([6], [-1.0], [Segment(0, 1)], SampleStatus.COMPLETED),  # "2"
    ]
    keyed = Scorer(spec(reward_function=f"{HERE}:async_dict_reward", reward_key="copied").rollout, tokenizer)
    assert asyncio.run(keyed.score(prompt, samples)) == [(1.0, None), (0.0, None)]
    unkeyed = Scorer(spec(reward_function=f"{HERE}:async_dict_reward").rollout, tokenizer)
    assert all(
        reward is None and "set rollout.reward_key" in why
        for reward, why in asyncio.run(unkeyed.score(prompt, samples))
    )
    group = Scorer(spec(group_reward_function=f"{HERE}:group_reward_ranks").rollout, tokenizer)
    assert asyncio.run(group.score(prompt, samples)) == [(1.0, None), (0.0, None)]


def test_what_a_users_function_gets_wrong_is_skipped_and_counted():
    result, _ = filled(
        spec(generate_function=f"{HERE}:generate_that_fails_on_fives", reward="tests.rewards:fake_digit_share")
    )
    assert len(result.groups) == 4
    unscorable = [group for group, reason in result.dropped if reason is DropReason.UNSCORABLE]
    assert unscorable and all(group.prompt.label == "5" for group in unscorable)
    assert "the generate function failed: ValueError: no fives" in result.errors[0]
    assert result.metrics["rollout/unscorable_samples"] == len(result.errors)

    def one_reward_for_two(items):
        return [1.0]

    with pytest.raises(GaveUp, match=r"returned \[1.0\], not a list of 2 rewards"):
        filled(
            spec(group_reward_function=f"{HERE}:group_reward_ranks", max_consecutive_bad_samples=6),
            group_function=one_reward_for_two,
        )


async def generate_that_fails_on_fives(sample, engine) -> Generated:
    if sample.prompt.label == "5":
        raise ValueError("no fives")
    result = await engine.generate(sample.prompt_ids, sample.sampling_params)
    count = len(result["output_ids"])
    return Generated(result["output_ids"], [1] * count, [e[0] for e in result["meta_info"]["output_token_logprobs"]])


async def generate_breaking_its_contract_on_fives(sample, engine) -> Generated:
    """A fake generate function that, for label 5, breaks the contract the way ``BROKEN`` names."""
    if sample.prompt.label == "5" and BROKEN == "no engine call":
        return Generated([5], [1], [0.0])
    result = await engine.generate(sample.prompt_ids, sample.sampling_params)
    output = list(result["output_ids"])
    if sample.prompt.label == "5" and BROKEN == "too many tokens":
        output = output[:1] * (sample.sampling_params["max_new_tokens"] + 1)
    metadata = {"tools": {"calculator"}} if sample.prompt.label == "5" and BROKEN == "a set in metadata" else {}
    return Generated(output, [1] * len(output), [-1.0] * len(output), metadata=metadata)


BROKEN = ""


@pytest.mark.parametrize(
    ("broken", "reason"),
    [
        ("no engine call", "it never called the engine"),
        ("too many tokens", "25 tokens after the prompt, over max_new_tokens (24)"),
        ("a set in metadata", "metadata is not JSON-serialisable"),
    ],
)
def test_a_generated_sample_that_breaks_its_contract_is_bad_data(broken, reason, monkeypatch):
    monkeypatch.setattr(f"{HERE}.BROKEN", broken)
    job = spec(
        generate_function=f"{HERE}:generate_breaking_its_contract_on_fives", reward="tests.rewards:fake_digit_share"
    )
    result, _ = filled(job)
    assert len(result.groups) == 4
    unscorable = [group for group, why in result.dropped if why is DropReason.UNSCORABLE]
    assert unscorable and all(group.prompt.label == "5" for group in unscorable)
    assert all("the generate function's answer is unusable" in error and reason in error for error in result.errors)
    assert result.metrics["rollout/unscorable_samples"] == len(result.errors)
    to_batch(result.groups, pad_id=0)  # every kept sample has a weight version


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"generate_function": CALCULATOR, "partial_rollout": True}, "partial_rollout cannot abort and continue"),
        ({"reward_function": "nocolon"}, "give a user function as module:function"),
        ({"reward_function": "a:b", "group_reward_function": "a:c"}, "not both"),
    ],
)
def test_bad_function_options_are_named(rollout, message):
    with pytest.raises(SpecError, match=message):
        spec(**rollout)
