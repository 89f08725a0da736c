"""A client that reaches a job's engines without the router: their URLs come from etcd.

erld records every engine it runs under ``/erl/jobs/<job>/procs/`` with its URL
and whether it is serving (registered after it answered and loaded the current
weights). ``DirectEngineClient`` reads that list (at most once a
``DIRECTORY_REFRESH_S``: a rollout sends hundreds of requests at once) and
sends each request to the next serving engine in turn, one attempt each,
moving on to the next engine when one fails (a stream, only while none of it
has arrived: after that its caller continues it). It is what generation goes
through while the router is down (``engines.access``), and the path by which
a request can be sent to an engine of one's choosing. While etcd does not
answer, the engines last read go on serving: an outage of the control plane
is no reason to stop generating.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from elastic_rl.engines.client import EngineClient, open_session
from elastic_rl.engines.streaming import Received
from elastic_rl.errors import EngineError, EngineRejected
from elastic_rl.store import keys
from elastic_rl.store.client import Store, StoreUnavailable

log = logging.getLogger("elastic_rl.engines.direct")

EngineDirectory = Callable[[], Awaitable[list[str]]]
"""Returns the URLs of the job's serving engines."""
DIRECTORY_REFRESH_S = 1.0
ENGINE_ROLE, TEACHER_ROLE = "engine", "teacher"
"""The roles of erld's records of the policy's engines and of a distillation teacher's (``daemon.plan.Role``)."""


def engines_in_etcd(store: Store, job: str, role: str = ENGINE_ROLE) -> EngineDirectory:
    """The serving engines of ``job`` as erld records them: the policy's (``engine``), or with ``role``
    ``teacher`` a distillation teacher's."""

    async def serving() -> list[str]:
        records = await store.get_prefix(keys.procs(job))
        return sorted(
            record["url"]
            for record in records.values()
            if record.get("role") == role and record.get("serving") and record.get("state") == "running"
        )

    return serving


class DirectEngineClient:
    """Generation straight to the job's serving engines, in turn; inside ``async with``, over connections
    kept open for the whole run."""

    def __init__(self, directory: EngineDirectory, timeout_s: float):
        self.directory = directory
        self.timeout_s = timeout_s
        self.requests = 0
        """Generation requests sent so far (the job's metric rollout/direct_requests)."""
        self._turn = 0
        self._serving: list[str] = []
        self._read_at = float("-inf")
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> DirectEngineClient:
        self._session = open_session()
        return self

    async def __aexit__(self, *exc_info) -> None:
        session, self._session = self._session, None
        await session.close()

    async def urls(self) -> set[str]:
        return set(await self._serving_engines())

    async def _serving_engines(self) -> list[str]:
        if time.monotonic() - self._read_at >= DIRECTORY_REFRESH_S:
            try:
                self._serving = await self.directory()
            except StoreUnavailable:
                if self._read_at == float("-inf"):
                    raise  # nothing read yet: no engines to fall back on
                log.warning("etcd did not answer: the %d engines last read serve on", len(self._serving))
            self._read_at = time.monotonic()
        return self._serving

    async def wait_serving(self) -> None:
        """Return once an engine serves (erld may still be starting or replacing them)."""
        while not await self._serving_engines():
            await asyncio.sleep(DIRECTORY_REFRESH_S)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        """One engine's answer; each serving engine is tried once, starting with the next in turn.
        Raises EngineError when none answers (or none is serving)."""
        return await self._in_turn(lambda engine: engine.generate(input_ids, sampling_params), lambda: False)

    async def input_logprobs(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        """``EngineClient.input_logprobs`` on the serving engines in turn, until one answers."""
        return await self._in_turn(lambda engine: engine.input_logprobs(sequences, starts), lambda: False)

    async def generate_stream(
        self, input_ids: list[int], sampling_params: dict[str, Any], received: Received, silence_s: float | None
    ) -> dict[str, Any]:
        """``EngineClient.generate_stream`` on the serving engines in turn, each tried while none has
        streamed a token: a stream that breaks after that raises, for the caller to continue it."""
        return await self._in_turn(
            lambda engine: engine.generate_stream(input_ids, sampling_params, received, silence_s),
            lambda: bool(received.output_ids),
        )

    async def _in_turn(
        self, call: Callable[[EngineClient], Awaitable[dict[str, Any]]], started: Callable[[], bool]
    ) -> dict[str, Any]:
        """``call`` on each serving engine once, starting with the next in turn, until one answers or
        ``started()`` says the request has begun somewhere (then its failure is raised)."""
        urls = await self._serving_engines()
        if not urls:
            raise EngineError("no engine is serving (direct to the engines, the router being down)")
        # The turn is taken as the request is sent: the requests of a rollout are sent all at once.
        first, self._turn = self._turn, self._turn + 1
        errors = []
        for offset in range(len(urls)):
            url = urls[(first + offset) % len(urls)]
            self.requests += 1
            try:
                return await call(EngineClient(url, self.timeout_s, attempts=1, session=self._session))
            except EngineRejected:
                raise
            except EngineError as exc:
                if started():
                    raise
                log.warning("engine %s did not answer a direct request: %s", url, exc)
                errors.append(str(exc))
        raise EngineError(f"no serving engine answered directly; the last: {errors[-1]}")
