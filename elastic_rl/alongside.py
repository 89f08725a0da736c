"""A coroutine that runs beside a block for exactly as long as the block: the orchestrator's periodic
work during generation (persisting the in-flight log, measuring the engines' paces)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def alongside(work: Coroutine[Any, Any, Any]) -> AsyncIterator[None]:
    """Run ``work`` as a task while the block runs; when the block ends, cancel it and wait for it to end."""
    task = asyncio.create_task(work)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
