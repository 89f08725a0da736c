"""Dynamic sampling: fills a rollout with scored groups.

For each rollout the ``GroupSampler`` first takes groups from the buffer (the
ones within the staleness bound; ``rollout.buffer_filter`` picks which), then
generates rounds of ``rollout.round_size`` prompts through the router until
the rollout has ``prompts_per_rollout`` groups that could be scored and that
``rollout.dynamic_filter`` keeps. What it drops is returned with the reason
(stale, unscorable, filtered); what is left over stays in the buffer. A
sample's seed depends on (job seed, rollout, round, sample) only, so a
restarted orchestrator generates exactly what the lost one would have.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from elastic_rl.algo.choices import AlgorithmKind
from elastic_rl.config import JobSpec, RolloutSpec
from elastic_rl.engines.router import RouterClient
from elastic_rl.errors import ElasticRLError
from elastic_rl.plugins import load_function
from elastic_rl.rollout.data import DataSource, Prompt
from elastic_rl.rollout.groups import Group, GroupBuffer, Sample, fifo
from elastic_rl.rollout.prompts import render, render_response
from elastic_rl.rollout.rewards import load_reward
from policies.dynamic_sampling import ConsecutiveFailures, zero_std

Drawn = tuple[Prompt, list[int], list[int]]
"""A prompt, its token ids and, for SFT, its response's token ids (else empty)."""


class GaveUp(ElasticRLError):
    """A failure budget ran out: the job fails, with this as its reason."""


class DropReason(Enum):
    STALE = "stale"
    UNSCORABLE = "unscorable"
    FILTERED = "filtered"


def derived_seed(*parts: object) -> int:
    """A 32-bit seed from its parts alone (job seed first): the same parts, the same seed, in any process."""
    digest = hashlib.sha256("/".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def stop_params(rollout: RolloutSpec) -> dict[str, list]:
    """The sampling parameters that end a response, beside the tokenizer's end-of-sequence ids."""
    params: dict[str, list] = {}
    if rollout.stop:
        params["stop"] = list(rollout.stop)
    if rollout.stop_token_ids:
        params["stop_token_ids"] = list(rollout.stop_token_ids)
    return params


@dataclass
class Filled:
    """What filling one rollout did."""

    groups: list[Group]
    drawn: list[Prompt] = field(default_factory=list)
    skipped: list[Prompt] = field(default_factory=list)
    """Drawn but over-long: never generated."""
    dropped: list[tuple[Group, DropReason]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Why samples could not be scored, one line each."""
    metrics: dict[str, float] = field(default_factory=dict)


class GroupSampler:
    def __init__(self, spec: JobSpec, tokenizer, router: RouterClient):
        self.spec = spec
        self.tokenizer = tokenizer
        self.router = router
        self.data = DataSource(spec.data, spec.seed)
        self.buffer = GroupBuffer()
        self.reward = load_reward(spec.rollout.reward)
        self.keep = self._group_filter(spec.rollout.dynamic_filter)
        choice = spec.rollout.buffer_filter
        self.choose = fifo if choice == "fifo" else load_function("rollout.buffer_filter", choice)
        self.bad_data = ConsecutiveFailures(spec.rollout.max_consecutive_bad_samples)
        concurrency = spec.rollout.max_concurrency
        self.in_flight = asyncio.Semaphore(concurrency) if concurrency else None

    @staticmethod
    def _group_filter(name: str | None):
        if name is None:
            return None
        if name == "zero_std":
            return lambda group: zero_std(group.rewards)
        return load_function("rollout.dynamic_filter", name)

    # --- state, committed with every rollout -------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict(), "buffer": self.buffer.to_json()}

    def load_state_dict(self, data_state: dict[str, int], buffer: list[dict[str, Any]]) -> None:
        self.data.load_state_dict(data_state)
        self.buffer = GroupBuffer.from_json(buffer)

    # --- drawing ------------------------------------------------------------------------

    def draw(self, wanted: int) -> tuple[list[Drawn], list[Prompt]]:
        """``wanted`` prompts that fit, and the over-long ones skipped on the way.

        A skipped prompt counts as drawn (it is never drawn again); the next prompt takes its place.
        For SFT a response longer than rollout.max_new_tokens is skipped like an over-long prompt.
        """
        rollout, limit = self.spec.rollout, self.spec.prompt_limit
        supervised = self.spec.algorithm.kind is AlgorithmKind.SFT
        kept: list[Drawn] = []
        skipped: list[Prompt] = []
        while len(kept) < wanted:
            if len(skipped) >= len(self.data.records):
                raise GaveUp(f"no prompt of the data fits rollout.max_prompt_len ({limit} tokens)")
            for prompt in self.data.draw(wanted - len(kept)):
                ids = render(self.tokenizer, self.spec.data, prompt.text)
                response = []
                if supervised:
                    response = render_response(self.tokenizer, self.spec.data, prompt.text, prompt.label)
                if len(ids) > limit or len(response) > rollout.max_new_tokens:
                    skipped.append(prompt)
                else:
                    kept.append((prompt, ids, response))
        return kept, skipped

    # --- generating ---------------------------------------------------------------------

    def sampling_params(self, rollout_id: int, index: int) -> dict[str, Any]:
        spec = self.spec.rollout
        params: dict[str, Any] = {
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "top_k": spec.top_k,
            "max_new_tokens": spec.max_new_tokens,
            **stop_params(spec),
        }
        if spec.deterministic:
            params["sampling_seed"] = derived_seed(self.spec.seed, rollout_id, index)
        return params

    async def _generate_one(self, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        if self.in_flight is None:
            return await self.router.generate(ids, params)
        async with self.in_flight:
            return await self.router.generate(ids, params)

    async def generate_round(
        self, rollout_id: int, round_index: int, prompts: list[Drawn], errors: list[str]
    ) -> tuple[list[Group], list[dict[str, Any]]]:
        """One round's groups, scored; and the engine's results (for the throughput metrics)."""
        n = self.spec.rollout.n_samples_per_prompt
        first = round_index * self.spec.rollout.round_size * n  # round 0 seeds as a rollout without rounds
        requests = [
            (ids, self.sampling_params(rollout_id, first + number * n + sample))
            for number, (_, ids, _) in enumerate(prompts)
            for sample in range(n)
        ]
        results = await asyncio.gather(*(self._generate_one(ids, params) for ids, params in requests))
        groups = []
        for number, (prompt, ids, _) in enumerate(prompts):
            samples = [self._scored(prompt, result, errors) for result in results[number * n : (number + 1) * n]]
            groups.append(Group(prompt, ids, samples))
        return groups, list(results)

    def _scored(self, prompt: Prompt, result: dict[str, Any], errors: list[str]) -> Sample:
        meta = result["meta_info"]
        sample = Sample(
            output_ids=list(result["output_ids"]),
            logprobs=[entry[0] for entry in meta["output_token_logprobs"]],
            version=int(meta["weight_version"]),
            finish=meta["finish_reason"]["type"],
        )
        response = self.tokenizer.decode(sample.output_ids, skip_special_tokens=True)
        try:
            reward = float(self.reward(prompt.text, response, prompt.label))
        except Exception as exc:  # a user's reward function: any error is bad data, not a dead job
            errors.append(f"prompt {prompt.index}: the reward raised {type(exc).__name__}: {exc}")
            reward = None
        if reward is not None and not math.isfinite(reward):
            errors.append(f"prompt {prompt.index}: the reward is {reward}")
            reward = None
        sample.reward = reward
        if self.bad_data.record(reward is None):
            raise GaveUp(
                f"{self.bad_data.count} samples in a row could not be scored "
                f"(rollout.max_consecutive_bad_samples); the last: {errors[-1]}"
            )
        return sample

    # --- filling a rollout -------------------------------------------------------------------

    async def fill(self, rollout_id: int) -> Filled:
        spec = self.spec.rollout
        wanted = spec.prompts_per_rollout
        filled = Filled([])
        stale = self.buffer.drop_older_than(rollout_id - spec.staleness_bound)
        filled.dropped += [(group, DropReason.STALE) for group in stale]
        filled.groups = self.buffer.take(wanted, self.choose)
        from_buffer = len(filled.groups)
        started = time.monotonic()
        results: list[dict[str, Any]] = []
        rounds = empty_rounds = 0
        while len(filled.groups) < wanted:
            prompts, skipped = self.draw(spec.round_size)
            filled.skipped += skipped
            filled.drawn += [prompt for prompt, _, _ in prompts]
            groups, round_results = await self.generate_round(rollout_id, rounds, prompts, filled.errors)
            results += round_results
            rounds += 1
            kept = 0
            for group in groups:
                if not group.scored:
                    filled.dropped.append((group, DropReason.UNSCORABLE))
                elif self.keep is not None and not self.keep(group):
                    filled.dropped.append((group, DropReason.FILTERED))
                else:
                    filled.groups.append(group)
                    kept += 1
            empty_rounds = 0 if kept else empty_rounds + 1
            if empty_rounds >= spec.max_filtered_rounds:
                raise GaveUp(
                    f"{empty_rounds} generation rounds in a row kept no group (rollout.max_filtered_rounds): "
                    f"rollout.dynamic_filter {spec.dynamic_filter} drops everything the model generates"
                )
        self.buffer.add(filled.groups[wanted:])
        filled.groups = filled.groups[:wanted]
        filled.metrics = self._metrics(filled, results, rounds, from_buffer, time.monotonic() - started)
        return filled

    def _metrics(self, filled: Filled, results: list[dict], rounds: int, from_buffer: int, elapsed: float) -> dict[str, float]:
        n = self.spec.rollout.n_samples_per_prompt
        rewards = [reward for group in filled.groups for reward in group.rewards]
        lengths = [len(sample.output_ids) for group in filled.groups for sample in group.samples]
        mean = sum(rewards) / len(rewards)
        generated_groups = len(results) // n
        filtered = sum(1 for _, reason in filled.dropped if reason is DropReason.FILTERED)
        metrics = {
            "rollout/reward_mean": mean,
            "rollout/reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) if len(rewards) > 1 else 0.0,
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/response_length_max": float(max(lengths)),
            "rollout/time": elapsed,
            "rollout/generation_rounds": float(rounds),
            "rollout/samples_generated": float(len(results)),
            "rollout/samples_used": float(len(rewards)),
            "rollout/groups_from_buffer": float(from_buffer),
            "rollout/buffered_groups": float(len(self.buffer)),
            "rollout/filtered_fraction": filtered / generated_groups if generated_groups else 0.0,
            "rollout/unscorable_samples": float(len(filled.errors)),
        }
        if results:
            longest = max(results, key=lambda r: r["meta_info"]["completion_tokens"])
            metrics["perf/generated_tokens_per_sec"] = sum(len(r["output_ids"]) for r in results) / max(elapsed, 1e-9)
            metrics["perf/longest_sample_tokens_per_sec"] = longest["meta_info"]["completion_tokens"] / max(
                longest["meta_info"]["e2e_latency"], 1e-9
            )
        return metrics
