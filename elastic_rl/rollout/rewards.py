"""Reward functions: built-in rules, or a user's ``module:function``.

A reward function takes (prompt, response, label) strings and returns a float
in [0, 1]. ``load_reward`` resolves the spec's ``rollout.reward``.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable

from math_verify import parse, verify

from elastic_rl.plugins import load_function

RewardFn = Callable[[str, str, str], float]


def toy_copy(prompt: str, response: str, label: str) -> float:
    """The toy task: the fraction of the label's characters the response repeats in place."""
    if not label:
        return 0.0
    return sum(a == b for a, b in zip(response, label)) / len(label)


def _normalise(text: str) -> str:
    text = text.lower().strip()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    return " ".join(text.split())


def exact_match(prompt: str, response: str, label: str) -> float:
    return float(_normalise(response) == _normalise(label))


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in ``text``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def _math_form(answer: str) -> str:
    answer = re.sub(r"\s+", "", answer).rstrip(".")
    answer = answer.replace("\\left", "").replace("\\right", "").replace("$", "")
    try:
        return repr(float(answer))
    except ValueError:
        return answer


def boxed_math(prompt: str, response: str, label: str) -> float:
    """1 when the response's last \\boxed{} answer equals the label (itself boxed or bare)."""
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    expected = last_boxed(label) or label
    return float(_math_form(answer) == _math_form(expected))


def f1(prompt: str, response: str, label: str) -> float:
    """Word-level F1 between the normalised response and label."""
    predicted, expected = _normalise(response).split(), _normalise(label).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def math(prompt: str, response: str, label: str) -> float:
    """1 when the response's final answer equals the label as mathematics (math-verify), else when
    its last number does."""
    gold = parse(label)
    answer = parse(response)
    if gold and answer and verify(gold, answer):
        return 1.0
    number = last_number(response)
    expected = last_number(label)
    return float(number is not None and expected is not None and float(number) == float(expected))


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "toy_copy": toy_copy,
    "exact_match": exact_match,
    "boxed_math": boxed_math,
    "f1": f1,
    "math": math,
}


def load_reward(name: str) -> RewardFn:
    return BUILTIN_REWARDS[name] if name in BUILTIN_REWARDS else load_function("rollout.reward", name)
