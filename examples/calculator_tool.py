"""A multi-turn generate function with a tool: the model writes, a calculator answers, the model
writes on. Give it to a job as

    rollout:
      generate_function: examples.calculator_tool:generate

(run from the repository root, so that `examples` is importable). Turn one is the model's, up to half
of max_new_tokens. The calculator then evaluates the last arithmetic expression in the model's text
(or, if it wrote none, in the prompt) and inserts its value as "[value]". Turn two is the model's again,
with what is left of max_new_tokens. Only the model's tokens are trained: the loss mask is 0 at the
calculator's. On the tiny model the tool is a toy; on a real model the first turn would be the model
asking for it.
"""

from __future__ import annotations

import operator
import re

from elastic_rl.rollout.generation import EngineSession, Generated, GenerateInput

EXPRESSION = re.compile(r"\d+(?:[+\-*]\d+)*")
LONGEST_ANSWER = 8  # characters of the value the calculator inserts, brackets included
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def calculate(text: str) -> str:
    """The value of the last expression of digits and + - * in ``text`` (left to right, no precedence),
    or "?" when there is none."""
    expressions = EXPRESSION.findall(text)
    if not expressions:
        return "?"
    numbers = re.split(r"[+\-*]", expressions[-1])
    value = int(numbers[0])
    for operation, number in zip(re.findall(r"[+\-*]", expressions[-1]), numbers[1:]):
        value = OPERATIONS[operation](value, int(number))
    return str(value)[: LONGEST_ANSWER - 2]


async def generate(sample: GenerateInput, engine: EngineSession) -> Generated:
    budget = sample.sampling_params["max_new_tokens"]  # every token after the prompt, the tool's too
    output: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []

    async def model_turn(turn: int, tokens: int) -> str:
        """The model writes up to ``tokens``; returns how it stopped (stop or length)."""
        params = {**sample.sampling_params, "max_new_tokens": tokens}
        if "sampling_seed" in params:  # each turn its own seed, still a function of the sample's
            params["sampling_seed"] = (params["sampling_seed"] + turn) % 2**32
        result = await engine.generate(sample.prompt_ids + output, params)
        output.extend(result["output_ids"])
        mask.extend([1] * len(result["output_ids"]))
        logprobs.extend(entry[0] for entry in result["meta_info"]["output_token_logprobs"])
        return result["meta_info"]["finish_reason"]["type"]

    finish = await model_turn(0, max(1, budget // 2))
    tool_calls = []
    if finish == "length" and budget - len(output) > LONGEST_ANSWER:  # the model did not end its answer
        written = sample.tokenizer.decode(output, skip_special_tokens=True)
        answer = "[" + calculate(written if EXPRESSION.search(written) else sample.prompt.text) + "]"
        tool_ids = sample.tokenizer(answer, add_special_tokens=False)["input_ids"]
        tool_calls.append({"answer": answer, "start": len(output), "end": len(output) + len(tool_ids)})
        output.extend(tool_ids)
        mask.extend([0] * len(tool_ids))
        logprobs.extend([0.0] * len(tool_ids))
        finish = await model_turn(1, budget - len(output))
    status = "truncated" if finish == "length" else "completed"
    return Generated(output, mask, logprobs, status, {"tool_calls": tool_calls, "turns": 1 + len(tool_calls)})
