"""Scoring: a reward for each generated sample, from whichever reward the spec names.

- ``rollout.reward``: a built-in rule or a user's ``module:function(prompt, response, label)``;
- ``rollout.reward_function``: a user's function given the whole sample (a ``RewardInput``);
- ``rollout.group_reward_function``: a user's function given a group's samples at once (a reward
  model that compares them), returning one reward each;
- ``rollout.reward_model``: a reward model served over HTTP (``reward_model.RewardModel``).

A user's function may be async, and may return a dict: ``rollout.reward_key`` names the reward in
it. A sample that cannot be scored (the function raised, or returned something other than a finite
number) gets None and a line saying why; the rollout side skips its group and counts it. A reward
model that does not answer is not bad data: its client waits for it, and fails the job only when its
budget is spent.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

from elastic_rl.plugins import load_function
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.groups import Sample
from elastic_rl.rollout.reward_model import RewardModel
from elastic_rl.rollout.rewards import load_reward
from elastic_rl.spec.rollout import RolloutSpec


@dataclass
class RewardInput:
    """What a reward_function (or, as a list, a group_reward_function) is given."""

    prompt: Prompt
    """The prompt: its text, its label (the reference answer) and its index in the data."""
    response: str
    """The sample's output tokens as text, special tokens left out (tool output included)."""
    sample: Sample
    """The sample itself: tokens, loss mask, status, the generate function's metadata."""


Scored = tuple[float | None, str | None]
"""A reward, or None and why it could not be computed."""


class Scorer:
    def __init__(self, rollout: RolloutSpec, tokenizer):
        self.rollout = rollout
        self.tokenizer = tokenizer
        self.group_function = None
        self.function = None
        self.rule = None
        self.reward_model = None
        # Where a dict's reward is, and the field that says so.
        self.reward_key, self.reward_key_field = rollout.reward_key, "rollout.reward_key"
        if rollout.reward_model is not None:
            self.reward_model = RewardModel(rollout.reward_model)
            self.reward_key, self.reward_key_field = rollout.reward_model.reward_key, "rollout.reward_model.reward_key"
        elif rollout.group_reward_function:
            self.group_function = load_function("rollout.group_reward_function", rollout.group_reward_function)
        elif rollout.reward_function:
            self.function = load_function("rollout.reward_function", rollout.reward_function)
        else:
            self.rule = load_reward(rollout.reward)

    async def score(self, prompt: Prompt, samples: list[Sample]) -> list[Scored]:
        if any(sample.error for sample in samples):  # a generate function failed: the group cannot be scored
            sibling = self._why(prompt, "another sample of its group could not be generated")
            return [(None, sample.error or sibling) for sample in samples]
        inputs = [
            RewardInput(prompt, self.tokenizer.decode(sample.output_ids, skip_special_tokens=True), sample)
            for sample in samples
        ]
        if self.reward_model is not None:
            return await self._score_remotely(prompt, inputs)
        if self.group_function is not None:
            try:
                values = await _called(self.group_function, inputs)
            except Exception as exc:  # a user's function: any error is bad data, not a dead job
                return [(None, self._why(prompt, f"the group reward raised {type(exc).__name__}: {exc}"))] * len(
                    samples
                )
            if not isinstance(values, (list, tuple)) or len(values) != len(samples):
                why = f"the group reward returned {values!r:.80}, not a list of {len(samples)} rewards"
                return [(None, self._why(prompt, why))] * len(samples)
            return [self.checked(prompt, value) for value in values]
        scored = []
        for item in inputs:
            try:
                if self.function is not None:
                    value = await _called(self.function, item)
                else:
                    value = self.rule(prompt.text, item.response, prompt.label)
            except Exception as exc:  # a user's function: any error is bad data, not a dead job
                scored.append((None, self._why(prompt, f"the reward raised {type(exc).__name__}: {exc}")))
                continue
            scored.append(self.checked(prompt, value))
        return scored

    @property
    def reward_model_failures(self) -> int:
        """Requests the reward model did not answer since the count was last set to zero."""
        return self.reward_model.failures if self.reward_model is not None else 0

    def count_from_zero(self) -> None:
        """A rollout begins: its failures are counted from here."""
        if self.reward_model is not None:
            self.reward_model.failures = 0

    async def _score_remotely(self, prompt: Prompt, inputs: list[RewardInput]) -> list[Scored]:
        bodies = [
            {"prompt": prompt.text, "response": item.response, "label": prompt.label, "metadata": item.sample.metadata}
            for item in inputs
        ]
        return [
            self.checked(prompt, value) if why is None else (None, self._why(prompt, why))
            for value, why in await self.reward_model.rewards(bodies)
        ]

    def checked(self, prompt: Prompt, value: Any) -> Scored:
        """``value`` as a reward (a number, or a dict's entry under the reward key), or None and why it is
        not one."""
        key, key_field = self.reward_key, self.reward_key_field
        if isinstance(value, dict):
            if key is None:
                return None, self._why(prompt, f"the reward returned a dict ({sorted(value)}): set {key_field}")
            if key not in value:
                return None, self._why(prompt, f"the reward's dict has no {key!r} ({key_field}): {sorted(value)}")
            value = value[key]
        try:
            reward = float(value)
        except (TypeError, ValueError):
            return None, self._why(prompt, f"the reward is {value!r:.80}, not a number")
        if not math.isfinite(reward):
            return None, self._why(prompt, f"the reward is {reward}")
        return reward, None

    @staticmethod
    def _why(prompt: Prompt, message: str) -> str:
        return f"prompt {prompt.index}: {message}"


async def _called(function, argument) -> Any:
    value = function(argument)
    return await value if inspect.isawaitable(value) else value
