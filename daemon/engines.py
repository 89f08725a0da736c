"""A job's engines as one node's agent sees them: registration with the router, and health checks.

An engine is registered with the router once its server answers; only a
registered ("serving") engine is health-checked. Each pass reads the load of
every serving engine of this node at once (``/metrics``: its progress counter
and whether it holds work) and ``policies.engine_health`` tells a hang from
load; an unhealthy one is taken out of the router and reported to the agent,
which kills it and restarts it under the job's restart policy. A router that
(re)starts has every serving engine of the job registered with it, wherever
the engines run: the engines' records in etcd carry their URLs.
"""

from __future__ import annotations

import asyncio
import logging
import time

from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.router import RouterClient
from policies.engine_health import EngineLoad, EngineWatch, HealthVerdict, judge

log = logging.getLogger("erld.engines")

ROUTER_START_TIMEOUT_S = 60.0


async def register(router_url: str, engine_url: str, startup_timeout_s: float, secret: str) -> None:
    """Register an engine once it answers. One already listed is removed first: that resets what
    the router remembers of a predecessor at the same address (an open circuit, its load)."""
    await EngineClient(engine_url).wait_healthy(startup_timeout_s)
    router = RouterClient(router_url, secret=secret)
    await router.wait_healthy(ROUTER_START_TIMEOUT_S)
    if engine_url in await router.worker_urls():
        await router.remove_worker(engine_url)
    await router.add_worker(engine_url)


async def register_all(router_url: str, engine_urls: list[str], secret: str) -> None:
    """Register every listed engine with a router that just (re)started."""
    router = RouterClient(router_url, secret=secret)
    await router.wait_healthy(ROUTER_START_TIMEOUT_S)
    present = await router.worker_urls()
    for engine_url in engine_urls:
        if engine_url not in present:
            await router.add_worker(engine_url)


async def unregister(router_url: str, engine_url: str, secret: str) -> None:
    try:
        await RouterClient(router_url, secret=secret).remove_worker(engine_url)
    except Exception as exc:  # the router may be down too; its restart registers only live engines
        log.warning("removing %s from the router at %s failed: %s", engine_url, router_url, exc)


async def prune(router_url: str, engine_urls: set[str], secret: str) -> None:
    """Take out of the router every worker that is none of ``engine_urls`` (the job's assigned
    engines): a dead node's engines, which no agent is left to remove, would otherwise stay there
    and hold every weight update waiting for them."""
    router = RouterClient(router_url, secret=secret)
    try:
        for stale in set(await router.worker_urls()) - engine_urls:
            log.info("engine %s is no longer assigned: taking it out of the router", stale)
            await router.remove_worker(stale)
    except Exception as exc:  # the router may be starting or moving; the next pass tries again
        log.warning("pruning the router at %s failed: %s", router_url, exc)


async def loads(engine_urls: dict[str, str], timeout_s: float) -> dict[str, EngineLoad | None]:
    """Each engine's load (name -> URL in, name -> load out; None for one that did not answer)."""
    read = await asyncio.gather(*(EngineClient(url).load(timeout_s) for url in engine_urls.values()))
    return dict(zip(engine_urls, read))


def judged(
    read: dict[str, EngineLoad | None], watches: dict[str, EngineWatch], hang_timeout_s: float
) -> dict[str, HealthVerdict]:
    """The verdict on each engine of one health pass; updates ``watches`` in place."""
    now = time.time()
    verdicts = {}
    for name, load in read.items():
        verdicts[name] = judge(watches.get(name) or EngineWatch(now), load, now, hang_timeout_s)
        watches[name] = verdicts[name].watch
    return verdicts
