"""Eval: held-out prompt sets generated through the job's own engines every ``eval.interval_rollouts``.

Before generating rollout N, when N is a multiple of the interval, the
orchestrator asks the ``Evaluator`` for each dataset's metrics with the
weights the engines serve then (version N in sync mode, N - max_staleness in
async). They join the rollout's metrics line as ``eval/<name>/...``; eval
samples never enter the rollout log, so nothing trains on them. Each eval sample's seed depends on (job seed,
dataset, rollout, sample) only, so a restarted orchestrator measures the same.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from elastic_rl.config import EvalDataset, JobSpec
from elastic_rl.rollout.data import jsonl_lines
from elastic_rl.rollout.prompts import render
from elastic_rl.rollout.rewards import load_reward
from elastic_rl.rollout.generation import derived_seed, stop_params

Generate = Callable[[list[int], dict[str, Any]], Awaitable[dict[str, Any]]]


class Evaluator:
    def __init__(self, spec: JobSpec, tokenizer, generate: Generate):
        self.spec = spec
        self.tokenizer = tokenizer
        self.generate = generate
        self.reward = load_reward(spec.rollout.reward)
        self.datasets: list[tuple[EvalDataset, list[tuple[str, str, list[int]]]]] = []
        for dataset in spec.eval.datasets:
            lines = jsonl_lines(dataset.path, spec.data.prompt_key, spec.data.label_key)
            prompts = [(text, label, render(tokenizer, spec.data, text)) for _, text, label in lines]
            self.datasets.append((dataset, prompts))

    def due(self, rollout_id: int) -> bool:
        interval = self.spec.eval.interval_rollouts
        return bool(self.datasets) and interval > 0 and rollout_id % interval == 0

    def sampling_params(self, dataset: EvalDataset, rollout_id: int, index: int) -> dict[str, Any]:
        rollout, sampling = self.spec.rollout, dataset.sampling
        params: dict[str, Any] = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "max_new_tokens": sampling.max_new_tokens or rollout.max_new_tokens,
            "sampling_seed": derived_seed(self.spec.seed, "eval", dataset.name, rollout_id, index),
            **stop_params(rollout),
        }
        return params

    async def run(self, rollout_id: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for dataset, prompts in self.datasets:
            metrics.update(await self._one(dataset, prompts, rollout_id))
        return metrics

    async def _one(self, dataset: EvalDataset, prompts: list[tuple[str, str, list[int]]], rollout_id: int) -> dict[str, float]:
        started = time.monotonic()
        limit = self.spec.prompt_limit
        fitting = [(text, label, ids) for text, label, ids in prompts if len(ids) <= limit]
        n = dataset.n_samples_per_prompt
        requests = [(text, label, ids, self.sampling_params(dataset, rollout_id, number * n + sample))
                    for number, (text, label, ids) in enumerate(fitting) for sample in range(n)]  # fmt: skip
        results = await asyncio.gather(*(self.generate(ids, params) for _, _, ids, params in requests))
        rewards, lengths, unscorable = [], [], 0
        for (text, label, _, _), result in zip(requests, results):
            response = self.tokenizer.decode(result["output_ids"], skip_special_tokens=True)
            lengths.append(len(result["output_ids"]))
            try:
                reward = float(self.reward(text, response, label))
            except Exception:  # a user's reward function: an eval sample it cannot score is counted
                reward = math.nan
            if math.isfinite(reward):
                rewards.append(reward)
            else:
                unscorable += 1
        prefix = f"eval/{dataset.name}/"
        metrics = {
            prefix + "samples": float(len(results)),
            prefix + "skipped_prompts": float(len(prompts) - len(fitting)),
            prefix + "unscorable_samples": float(unscorable),
            prefix + "time": time.monotonic() - started,
        }
        if rewards:  # none when every prompt was too long or no sample could be scored
            metrics[prefix + "reward_mean"] = sum(rewards) / len(rewards)
            metrics[prefix + "response_length_mean"] = sum(lengths) / len(lengths)
        return metrics
