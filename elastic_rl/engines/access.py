"""How the orchestrator reaches the engines: through the router while it answers, straight to the
engines (``engines.direct``) while it does not.

A generation request that fails at the router before anything of it arrived is sent again, once,
straight to a serving engine if the router turns out not to answer (it died with the request in
flight: the engine that held it aborts it as its client went away, and nobody reads that answer, so
no sample is made twice). A stream that had begun is not sent again here: its caller continues it
from the tokens that arrived. From then on every request goes direct, and the router's health is
asked at most once a ``ROUTER_PROBE_S``; once it answers again with engines registered (erld
restarts it and registers the serving engines with it), requests go through it again. The engine
list follows the same rule. Without a direct client (no etcd: a job run outside erld) every call
goes to the router.

With a ``PaceMeter`` (``engines.pace``), while one engine generates well below
its peers' pace, each new stream goes to the engine the meter picks by its
share instead of the router's even choice; one that fails there before any of
it arrived goes through the router after all.

A request that asks for its routing record (algorithm.routing_replay) goes
straight to the engines as well: sglang-router's request type has no
``return_routed_experts`` and drops it on the way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from elastic_rl.engines.direct import DirectEngineClient
from elastic_rl.engines.pace import PaceMeter
from elastic_rl.engines.router import RouterClient, abort_everywhere
from elastic_rl.engines.streaming import Received
from elastic_rl.errors import EngineError, EngineRejected

log = logging.getLogger("elastic_rl.engines.access")

T = TypeVar("T")
ROUTER_PROBE_S = 1.0
PROBE_TIMEOUT_S = 1.0


class EngineAccess:
    def __init__(self, router: RouterClient, direct: DirectEngineClient | None = None, pacing: PaceMeter | None = None):
        self.router = router
        self.direct = direct
        self.pacing = pacing
        self._probe = RouterClient(router.base_url, timeout_s=PROBE_TIMEOUT_S, attempts=1, secret=router.secret)
        self._router_down = False
        self._last_probe = 0.0

    @property
    def direct_requests(self) -> int:
        return self.direct.requests if self.direct is not None else 0

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        return await self._router_or_direct(
            lambda: self.router.generate(input_ids, sampling_params),
            lambda: self.direct.generate(input_ids, sampling_params),
        )

    async def generate_stream(
        self, input_ids: list[int], sampling_params: dict[str, Any], received: Received, silence_s: float | None = None
    ) -> dict[str, Any]:
        """``generate`` streamed into ``received`` (a stream silent for ``silence_s`` is broken). A stream
        that breaks after a token arrived is not sent again here (that would start it over): the
        EngineError reaches the caller, who continues it from what arrived; the next call goes straight to
        the engines if the router turned out to be down."""
        engine = self.pacing.pick() if self.pacing is not None else None
        if engine is not None:
            try:
                return await self.router.client_for(engine).generate_stream(
                    input_ids, sampling_params, received, silence_s
                )
            except EngineRejected:
                raise
            except EngineError as exc:
                if received.output_ids:
                    raise
                log.warning("engine %s did not answer a paced request: through the router instead (%s)", engine, exc)
        if received.routing_shape is not None and self.direct is not None:
            return await self.direct.generate_stream(input_ids, sampling_params, received, silence_s)
        return await self._router_or_direct(
            lambda: self.router.generate_stream(input_ids, sampling_params, received, silence_s),
            lambda: self.direct.generate_stream(input_ids, sampling_params, received, silence_s),
            retry_direct=lambda: not received.output_ids,
        )

    async def worker_urls(self) -> set[str]:
        """The engines requests go to: the router's workers, or the serving engines while it is down."""
        return await self._router_or_direct(self.router.worker_urls, lambda: self.direct.urls())

    async def _router_or_direct(
        self,
        through_router: Callable[[], Awaitable[T]],
        direct: Callable[[], Awaitable[T]],
        retry_direct: Callable[[], bool] = lambda: True,
    ) -> T:
        """``through_router()``; ``direct()`` instead while the router is down, and for a call the router
        failed without answering (if ``retry_direct()`` allows it then)."""
        if await self._use_direct():
            return await direct()
        try:
            return await through_router()
        except EngineRejected:
            raise  # the router answered: it refused the request itself
        except EngineError:
            if self.direct is None or await self._router_answers():
                raise  # the router answers: the failure is the engines', retried as such
            self._going_direct()
            if not retry_direct():
                raise
            return await direct()

    async def every_engine(self) -> set[str]:
        """Every engine a request may reach: the router's workers and, under erld, every engine it
        records as serving (a router that has just restarted lists only those registered so far)."""
        urls = await self.worker_urls()
        return urls | await self.direct.urls() if self.direct is not None else urls

    async def abort_on_every_worker(self) -> list[str]:
        """Abort every request the engines hold, on the engines requests go to (``abort_everywhere``)."""
        return await abort_everywhere(sorted(await self.worker_urls()), self.router.secret)

    # --- the router's state ---------------------------------------------------------

    async def _use_direct(self) -> bool:
        """Whether to bypass the router now: it was down, and a probe (at most one a ROUTER_PROBE_S)
        has not found it back."""
        if not self._router_down or time.monotonic() - self._last_probe < ROUTER_PROBE_S:
            return self._router_down
        self._last_probe = time.monotonic()
        if await self._router_answers():
            log.info("the router at %s answers again: generation goes through it", self.router.base_url)
            self._router_down = False
        return self._router_down

    async def _router_answers(self) -> bool:
        """The router answers and has engines to send requests to (a restarted one has none until
        erld registers them)."""
        try:
            return bool(await self._probe.worker_urls())
        except EngineError:
            return False

    def _going_direct(self) -> None:
        if not self._router_down:
            log.warning(
                "the router at %s does not answer: generation goes straight to the engines", self.router.base_url
            )
        self._router_down = True
        self._last_probe = time.monotonic()
