"""Eval: held-out prompt sets generated through the job's own engines every ``eval.interval_rollouts``.

Before generating rollout N, when N is a multiple of the interval, the
orchestrator asks the ``Evaluator`` for each dataset's metrics with the
weights the engines serve then (version N in sync mode, N - max_staleness in
async). They join the rollout's metrics line as ``eval/<name>/...``; eval
samples never enter the rollout log, so nothing trains on them. Each eval sample's seed depends on (job seed,
dataset, rollout, sample) only, so a restarted orchestrator measures the same.
Eval samples are made and scored as rollout samples are (the same generate
function, reward, retries and rollout.max_concurrency), with the dataset's
sampling.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from elastic_rl.rollout.data import Prompt, jsonl_lines
from elastic_rl.rollout.generation import GroupGenerator, derived_seed, stop_params
from elastic_rl.rollout.prompts import render
from elastic_rl.rollout.scoring import Scored, Scorer
from elastic_rl.spec.eval import EvalDataset
from elastic_rl.spec.job import JobSpec


class Evaluator:
    def __init__(self, spec: JobSpec, tokenizer, generator: GroupGenerator, scorer: Scorer):
        self.spec = spec
        self.generator = generator
        self.scorer = scorer
        self.datasets: list[tuple[EvalDataset, list[tuple[Prompt, list[int]]]]] = []
        for dataset in spec.eval.datasets:
            lines = jsonl_lines(dataset.path, spec.data)
            prompts = [
                (Prompt(index, 0, text, label), render(tokenizer, spec.data, text)) for index, text, label, _ in lines
            ]
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

    async def _one(
        self, dataset: EvalDataset, prompts: list[tuple[Prompt, list[int]]], rollout_id: int
    ) -> dict[str, float]:
        started = time.monotonic()
        limit = self.spec.prompt_limit
        fitting = [(prompt, ids) for prompt, ids in prompts if len(ids) <= limit]
        n = dataset.n_samples_per_prompt

        async def group(number: int, prompt: Prompt, ids: list[int]) -> list[Scored]:
            samples = await asyncio.gather(
                *(
                    self.generator.make(prompt, ids, self.sampling_params(dataset, rollout_id, number * n + sample), [])
                    for sample in range(n)
                )
            )
            lengths.extend(len(sample.output_ids) for sample in samples)
            return await self.scorer.score(prompt, list(samples))

        lengths: list[int] = []
        scored = await asyncio.gather(*(group(number, prompt, ids) for number, (prompt, ids) in enumerate(fitting)))
        rewards = [reward for rewards in scored for reward, _ in rewards if reward is not None]
        prefix = f"eval/{dataset.name}/"
        metrics = {
            prefix + "samples": float(len(fitting) * n),
            prefix + "skipped_prompts": float(len(prompts) - len(fitting)),
            prefix + "unscorable_samples": float(len(fitting) * n - len(rewards)),
            prefix + "time": time.monotonic() - started,
        }
        if rewards:  # none when every prompt was too long or no sample could be scored
            metrics[prefix + "reward_mean"] = sum(rewards) / len(rewards)
            metrics[prefix + "response_length_mean"] = sum(lengths) / len(lengths)
        return metrics
