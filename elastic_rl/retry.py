"""The retry policy of every I/O boundary (etcd, HTTP): exponential backoff with jitter, bounded.

Never used around collectives. The last failure is re-raised as it was, so
the caller can turn it into an error a user can act on.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

T = TypeVar("T")

MAX_BACKOFF_S = 2.0


async def with_retries(
    call: Callable[[], Awaitable[T]],
    retry_on: tuple[type[BaseException], ...],
    attempts: int,
    first_backoff_s: float,
    before_retry: Callable[[], Awaitable[None]] | None = None,
    max_backoff_s: float = MAX_BACKOFF_S,
) -> T:
    """``call`` until it succeeds or ``attempts`` are spent; ``before_retry`` runs before each new try
    (the etcd client moves to its next endpoint there)."""

    async def prepare(_state) -> None:
        if before_retry is not None:
            await before_retry()

    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(retry_on),
        stop=stop_after_attempt(attempts),
        wait=_backoff(first_backoff_s, max_backoff_s),
        before_sleep=prepare,
        reraise=True,
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity re-raises the last failure")


def _backoff(first_s: float, max_s: float) -> Callable[[RetryCallState], float]:
    """``first_s`` doubled at each attempt, plus up to a second of jitter, at most ``max_s``.
    (tenacity's wait_exponential_jitter says the same, but warns about its own argument on every call,
    which cost the orchestrator about 15 % of its CPU.)"""

    def wait(state: RetryCallState) -> float:
        return min(max_s, first_s * 2 ** (state.attempt_number - 1) + random.uniform(0, 1))

    return wait
