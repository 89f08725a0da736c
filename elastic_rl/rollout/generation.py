"""Generation requests for the rollout side: a group's samples through the router, with their seeds,
retries and aborts.

``GroupGenerator.generate`` sends one request for each unfinished sample of a
group (a new one, or one a partial rollout aborted, continued from its tokens
so far) and returns the group with what each request made appended as a
segment. A request that fails after the router's and the client's own retries
is sent again with backoff, until ``rollout.max_request_failures`` failures in
a row give up on the job. ``rollout.max_concurrency`` caps the requests in
flight. Seeds are derived from (job seed, their parts) only, so a restarted
orchestrator sends exactly the requests the lost one would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from elastic_rl.config import JobSpec, RolloutSpec
from elastic_rl.engines.router import RouterClient
from elastic_rl.errors import EngineError, GaveUp
from elastic_rl.rollout.groups import Group, Sample, SampleStatus
from policies.dynamic_sampling import ConsecutiveFailures

log = logging.getLogger("elastic_rl.generation")

REQUEST_BACKOFF_S = 1.0
REQUEST_BACKOFF_MAX_S = 30.0
"""A failed generation request waits 1, 2, 4 ... s (at most 30) before it is sent again."""


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
class Work:
    """A group to generate, with the seed parts of its samples."""

    group: Group
    seeds: list[tuple]
    continued: bool = False
    """An earlier partial rollout aborted it; it is not aborted again."""


class GroupGenerator:
    def __init__(self, spec: JobSpec, router: RouterClient):
        self.spec = spec
        self.router = router
        concurrency = spec.rollout.max_concurrency
        self.in_flight = asyncio.Semaphore(concurrency) if concurrency else None
        self.full = False
        """Set by a partial rollout that has its groups: requests not yet sent are not sent, except a
        continued group's."""
        self.failed_requests = 0

    def sampling_params(self, seed_parts: tuple, generated: int = 0) -> dict[str, Any]:
        """A request's sampling parameters; ``generated`` tokens of the response exist already."""
        spec = self.spec.rollout
        params: dict[str, Any] = {
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "top_k": spec.top_k,
            "max_new_tokens": spec.max_new_tokens - generated,
            **stop_params(spec),
        }
        if spec.deterministic:
            params["sampling_seed"] = derived_seed(self.spec.seed, *seed_parts)
        return params

    async def generate(self, work: Work, results: list[dict[str, Any]]) -> Group:
        """The group with each unfinished sample generated on to its end, or until a partial rollout aborts it.

        The engine's answers are appended to ``results``.
        """
        group = work.group

        async def one(sample: Sample, seed: tuple) -> Sample:
            if sample.finished:
                return sample
            params = self.sampling_params(seed, len(sample.output_ids))
            result = await self._request(group.prompt_ids + sample.output_ids, params, abortable=not work.continued)
            if result is None:
                return sample
            results.append(result)
            meta = result["meta_info"]
            return sample.continued(
                list(result["output_ids"]),
                [entry[0] for entry in meta["output_token_logprobs"]],
                int(meta["weight_version"]),
                SampleStatus.from_finish_reason(meta["finish_reason"]["type"]),
            )

        samples = await asyncio.gather(*(one(sample, seed) for sample, seed in zip(group.samples, work.seeds)))
        return Group(group.prompt, group.prompt_ids, list(samples))

    async def abort(self) -> None:
        """Abort what the engines are generating; each request answers with what it made so far."""
        await self.router.abort_on_every_worker()

    async def _request(self, ids: list[int], params: dict[str, Any], abortable: bool) -> dict[str, Any] | None:
        """The engine's answer; None if a partial rollout filled up before an ``abortable`` request went out."""
        failures = ConsecutiveFailures(self.spec.rollout.max_request_failures)
        while True:
            try:
                async with self.in_flight or contextlib.nullcontext():
                    if self.full and abortable:
                        return None
                    return await self.router.generate(ids, params)
            except EngineError as exc:
                self.failed_requests += 1
                if failures.record(True):
                    raise GaveUp(
                        f"a generation request failed {failures.count} times in a row "
                        f"(rollout.max_request_failures); the last: {exc}"
                    ) from exc
                log.warning("a generation request failed (%d in a row); sending it again: %s", failures.count, exc)
                await asyncio.sleep(min(REQUEST_BACKOFF_MAX_S, REQUEST_BACKOFF_S * 2 ** (failures.count - 1)))
