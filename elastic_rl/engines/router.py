"""The router: sglang-router's own binary in front of the engines, and a client for its worker API.

``router_command`` builds the argv of ``python -m sglang_router.launch_router``
(through ``keyed_launch``, which gives it the job's secret) bound to loopback
with no workers (its Prometheus exporter needs a port of its own, or two
routers on one machine collide); engines are added and removed at run time
through ``RouterClient`` (``POST /workers``, ``DELETE /workers/{id}``). The
router retries a request whose engine fails on another engine, so a
generation survives the death of the engine that was serving it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

from elastic_rl.engines.client import EngineClient
from elastic_rl.errors import EngineError

log = logging.getLogger("elastic_rl.router")


def router_command(
    port: int,
    metrics_port: int,
    host: str = "127.0.0.1",
    policy: str = "round_robin",
    health_check_interval_s: int = 1,
    max_retries: int = 5,
    request_timeout_s: int = 1800,
    circuit_open_s: int = 2,
) -> list[str]:
    """The router's command line. Its circuit breaker reopens a failed engine after
    ``circuit_open_s``: erld replaces dead engines itself, so a long open circuit
    would only keep a healthy replacement out of rotation."""
    return [
        sys.executable,
        "-m",
        "elastic_rl.engines.keyed_launch",  # with the job's secret, kept off the command line
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
        "--health-check-interval-secs",
        str(health_check_interval_s),
        "--health-check-endpoint",
        "/health",
        "--retry-max-retries",
        str(max_retries),
        "--cb-timeout-duration-secs",
        str(circuit_open_s),
        "--request-timeout-secs",
        str(request_timeout_s),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
    ]


class RouterClient(EngineClient):
    """The router's generation API (inherited) plus its worker registry."""

    async def list_workers(self) -> list[dict[str, Any]]:
        return (await self._call("GET", "/workers"))["workers"]

    async def worker_urls(self) -> set[str]:
        return {worker["url"] for worker in await self.list_workers()}

    async def abort_on_every_worker(self) -> list[str]:
        """Abort every request the engines behind the router hold (``abort_everywhere``)."""
        return await abort_everywhere(sorted(await self.worker_urls()), self.secret)

    async def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """Register an engine and wait until the router lists it; the router sends the engine the job's
        secret (sglang-router uses a worker's own key, not its --api-key, with a worker added later)."""
        worker: dict[str, Any] = {"url": url}
        if self.secret:
            worker["api_key"] = self.secret
        await self._call("POST", "/workers", worker)
        await self._wait_until(lambda urls: url in urls, timeout_s, f"router did not add {url}")

    async def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Unregister an engine and wait until the router no longer lists it."""
        for worker in await self.list_workers():
            if worker["url"] == url:
                await self._call("DELETE", f"/workers/{worker['id']}")
        await self._wait_until(lambda urls: url not in urls, timeout_s, f"router did not remove {url}")

    async def _wait_until(self, done, timeout_s: float, message: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done(await self.worker_urls()):
                return
            await asyncio.sleep(0.1)
        raise EngineError(f"{message} within {timeout_s:.0f}s")


async def abort_everywhere(urls: list[str], secret: str | None = None) -> list[str]:
    """Abort every request the engines at ``urls`` hold, on all of them at once; they answer with what
    they generated so far. Returns why each abort that failed did ("url: error").

    One attempt per engine: a failed abort is not retried (a dying engine's requests are retried
    elsewhere, and a partial rollout aborts again while requests are out).
    """
    outcomes = await asyncio.gather(
        *(EngineClient(url, attempts=1, secret=secret).abort(abort_all=True) for url in urls),
        return_exceptions=True,
    )
    failed = []
    for url, outcome in zip(urls, outcomes):
        if isinstance(outcome, EngineError):
            failed.append(f"{url}: {outcome}")
            log.warning("could not abort the requests on %s: %s", url, outcome)
        elif isinstance(outcome, BaseException):
            raise outcome
    return failed
