"""A whole-rollout function with a tool loop: for every prompt and sample the model writes, a
calculator answers, the model writes on, for up to three turns. Give it to a job as

    rollout:
      rollout_function: examples.multi_turn_rollout:rollout

(run from the repository root, so that `examples` is importable). Each model turn may use up to a third
of max_new_tokens. A turn that the model ends itself (an end-of-sequence token or a stop string) ends
the sample; after one cut off at its length the calculator evaluates the last arithmetic expression in
everything so far (or, if there is none, in the prompt) and inserts its value as "[value]". Only the
model's tokens are trained: the loss mask is 0 at the calculator's. The samples carry no reward: the
job's reward (or reward model) scores them. A request the engine refuses makes that one sample an
error (its group is skipped and counted); anything else that fails fails the call, which the
orchestrator makes again.
"""

from __future__ import annotations

import asyncio

from elastic_rl.errors import EngineRejected
from elastic_rl.rollout.generation import EngineSession
from elastic_rl.rollout.rollout_function import RolloutInput, RolloutSample
from examples.calculator_tool import EXPRESSION, LONGEST_ANSWER, calculate

MAX_TURNS = 3


async def rollout(given: RolloutInput, engine: EngineSession) -> list[RolloutSample]:
    # A task group: if one sample fails, the others' engine calls are cancelled rather than left running.
    async with asyncio.TaskGroup() as samples:
        made = [
            samples.create_task(one_sample(given, engine, prompt.number, sample))
            for prompt in given.prompts
            for sample in range(given.n_samples_per_prompt)
        ]
    return [task.result() for task in made]


async def one_sample(given: RolloutInput, engine: EngineSession, number: int, sample: int) -> RolloutSample:
    prompt = given.prompts[number]
    budget = given.max_new_tokens  # every token after the prompt, the tool's too
    turn_budget = max(1, budget // MAX_TURNS)
    output: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: set[int] = set()
    tool_calls = []
    finish = "length"
    for turn in range(MAX_TURNS):
        params = given.sampling_params(number, sample, turn)
        params["max_new_tokens"] = min(turn_budget, budget - len(output))
        try:
            answer = await engine.generate(prompt.prompt_ids + output, params)
        except EngineRejected as exc:  # this sample's request is bad data: skipped and counted
            return RolloutSample(number, [], [], [], max(versions, default=0), error=str(exc))
        meta = answer["meta_info"]
        versions.add(int(meta["weight_version"]))
        output += answer["output_ids"]
        mask += [1] * len(answer["output_ids"])
        logprobs += [entry[0] for entry in meta["output_token_logprobs"]]
        finish = meta["finish_reason"]["type"]
        if finish != "length" or turn == MAX_TURNS - 1 or budget - len(output) <= LONGEST_ANSWER:
            break
        written = given.tokenizer.decode(output, skip_special_tokens=True)
        value = "[" + calculate(written if EXPRESSION.search(written) else prompt.prompt.text) + "]"
        tool_ids = given.tokenizer(value, add_special_tokens=False)["input_ids"]
        tool_calls.append({"answer": value, "start": len(output), "end": len(output) + len(tool_ids)})
        output += tool_ids
        mask += [0] * len(tool_ids)
        logprobs += [0.0] * len(tool_ids)
    return RolloutSample(
        prompt=number,
        output_ids=output,
        loss_mask=mask,
        logprobs=logprobs,
        weight_version=min(versions),  # the oldest weights that wrote any of it
        status="truncated" if finish == "length" else "completed",
        metadata={"tool_calls": tool_calls, "turns": 1 + len(tool_calls)},
    )
