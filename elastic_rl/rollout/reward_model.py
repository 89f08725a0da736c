"""A reward model served over HTTP (``rollout.reward_model``, slime's ``--rm-url`` contract): the
scorer's client for it.

Each sample is posted as JSON ``{"prompt", "response", "label", "metadata"}`` and the answer is its
reward: a number, or a dict that ``reward_model.reward_key`` names the reward in. With
``reward_model.batch_size`` above 1 a request carries a list of up to that many such objects, and the
answer is a list of as many rewards.

A reward model that is down or slow is an infrastructure failure, not bad data: a request that gets
no connection, times out, or is answered 5xx, 408 or 429 is sent again after 1, 2, 4 ... 30 s, each
failure counted, and only ``reward_model.max_failures`` in a row fail the job (``GaveUp``, with the
last reason); the groups waiting to be scored wait meanwhile. Whatever else it answers belongs to the
samples: a refusal (any other 4xx), a body that is not JSON or a list of the wrong length makes them
unscorable, which the scorer skips and counts as bad data, as it does a reward that is not a number.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson

from elastic_rl.errors import GaveUp
from elastic_rl.retry import with_retries
from elastic_rl.spec.rollout import RewardModelSpec

log = logging.getLogger("elastic_rl.reward_model")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
RETRIED_STATUSES = frozenset({408, 429})
"""Besides 5xx: the answers that say "not now" rather than "not this sample"."""

Answer = tuple[Any, str | None]
"""What the reward model answered for one sample, or None and why it gave no usable answer."""


class Unavailable(Exception):
    """The reward model did not answer: no connection, a timeout, or a status that asks to come back."""


class RewardModel:
    def __init__(self, spec: RewardModelSpec):
        self.spec = spec
        self.url = str(spec.url)
        self.failures = 0
        """Requests that found it unavailable, since the orchestrator last counted from zero."""

    async def rewards(self, samples: list[dict[str, Any]]) -> list[Answer]:
        """One answer per sample (each a JSON object of the contract), in order."""
        size = self.spec.batch_size
        batches = [samples[start : start + size] for start in range(0, len(samples), size)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.spec.timeout_s)) as session:
            answered = await asyncio.gather(*(self._batch(session, batch) for batch in batches))
        return [answer for batch in answered for answer in batch]

    async def _batch(self, session: aiohttp.ClientSession, batch: list[dict[str, Any]]) -> list[Answer]:
        body = batch[0] if self.spec.batch_size == 1 else batch
        try:
            status, text = await with_retries(
                lambda: self._post(session, body),
                (Unavailable,),
                self.spec.max_failures,
                FIRST_BACKOFF_S,
                max_backoff_s=MAX_BACKOFF_S,
            )
        except Unavailable as exc:
            raise GaveUp(
                f"the reward model at {self.url} failed {self.spec.max_failures} times in a row "
                f"(rollout.reward_model.max_failures); the last: {exc}"
            ) from None
        if status >= 400:
            return [(None, f"the reward model refused it: HTTP {status}: {text[:200]!r}")] * len(batch)
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            return [(None, f"the reward model's answer is not JSON: {text[:200]!r}")] * len(batch)
        if self.spec.batch_size == 1:
            return [(value, None)]
        if not isinstance(value, list) or len(value) != len(batch):
            why = f"the reward model answered {value!r:.80} to a batch of {len(batch)}, not a list of {len(batch)}"
            return [(None, why)] * len(batch)
        return [(item, None) for item in value]

    async def _post(self, session: aiohttp.ClientSession, body: Any) -> tuple[int, bytes]:
        try:
            async with session.post(
                self.url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
            ) as response:
                status, text = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._unavailable(f"{type(exc).__name__}: {exc}") from None
        if status >= 500 or status in RETRIED_STATUSES:
            raise self._unavailable(f"HTTP {status}: {text[:200]!r}")
        return status, text

    def _unavailable(self, why: str) -> Unavailable:
        self.failures += 1
        log.warning("the reward model at %s did not answer (%d failures so far): %s", self.url, self.failures, why)
        return Unavailable(why)
