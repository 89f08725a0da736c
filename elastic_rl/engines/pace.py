"""Engine pacing: each engine's pace measured from its ``/metrics``, and the engine each new request goes
to while one is well below its peers' pace (``policies.engine_pace``).

The router shares requests evenly (round robin), and a rollout's requests are
sent at once, so one slow engine would hold the whole rollout to its pace. The
orchestrator therefore reads every engine's load each ``POLL_S`` while it
generates: the tokens it has generated and the requests it is running (the
series SGLang and the cpu engine both serve). Between two reads an engine
generated so many tokens over so many request-seconds; its pace is the tokens
over the request-seconds of its last ``SAMPLES`` such intervals (tokens per
second per running request).

While the policy says no engine is slow, ``pick`` answers None and every
request goes through the router as usual. While one is, ``pick`` names the
engine for each new request by smooth weighted round robin over the shares, so
a quarter-speed engine gets about a fifth of two engines' requests. A slow
engine is never restarted for it: erld replaces only an engine that stops
generating (``policies.engine_health``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from elastic_rl.errors import EngineError
from policies.engine_health import EngineLoad
from policies.engine_pace import EVEN, PaceVerdict, judge

POLL_S = 1.0
"""How often every engine's load is read while the orchestrator generates."""
READ_TIMEOUT_S = 1.0
"""A read slower than this is skipped: the next one spans the gap."""
SAMPLES = 30
"""The intervals an engine's pace is measured over: its last 30 with requests running (about 30 s of
generation). Counted in intervals, not seconds, so that a pace measured in one rollout still holds for the
next after a long training step."""
MIN_SAMPLES = 5
"""Fewer intervals with requests running than this, an engine's pace is not known yet: a few seconds of an
engine taking on a rollout's requests (prefilling them) say little about its pace."""


@dataclass
class _Engine:
    last: tuple[float, EngineLoad] | None = None
    """The time and load of its last read."""
    intervals: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    """(tokens generated, request-seconds) between consecutive reads with requests running."""

    def read(self, now: float, load: EngineLoad) -> None:
        if self.last is not None:
            then, before = self.last
            tokens = load.generated_tokens - before.generated_tokens
            if tokens < 0:  # a restarted engine: what was measured was another process's pace
                self.intervals.clear()
            else:
                request_seconds = (before.running_requests + load.running_requests) / 2 * (now - then)
                if request_seconds > 0:
                    self.intervals.append((tokens, request_seconds))
        self.last = (now, load)

    @property
    def pace(self) -> float | None:
        if len(self.intervals) < MIN_SAMPLES:
            return None
        return sum(tokens for tokens, _ in self.intervals) / sum(seconds for _, seconds in self.intervals)


class PaceMeter:
    """The engines' paces, the policy's verdict on them, and the engine for each new request."""

    def __init__(self, factor: float):
        """``factor``: engines.straggler_factor."""
        self.factor = factor
        self.verdict: PaceVerdict = EVEN
        self.paced_requests = 0
        """Requests sent to the engine ``pick`` named, since the meter began."""
        self._engines: dict[str, _Engine] = {}
        self._credit: dict[str, float] = {}

    def read(self, loads: dict[str, EngineLoad | None], now: float) -> PaceVerdict:
        """Take one read of every engine requests may go to (None: it did not answer in time); engines
        no longer among them are forgotten. Returns the new verdict."""
        for gone in set(self._engines) - set(loads):
            del self._engines[gone]
        for url, load in loads.items():
            engine = self._engines.setdefault(url, _Engine())
            if load is not None:
                engine.read(now, load)
        self.verdict = judge({url: engine.pace for url, engine in self._engines.items()}, self.factor)
        shares = self.verdict.shares or {}
        self._credit = {url: self._credit.get(url, 0.0) for url in shares}
        return self.verdict

    def pick(self) -> str | None:
        """The engine for the next request, by its share; None while requests are shared evenly."""
        shares = self.verdict.shares
        if shares is None:
            return None
        for url, share in shares.items():
            self._credit[url] += share
        chosen = max(sorted(shares), key=lambda url: self._credit[url])
        self._credit[chosen] -= 1.0
        self.paced_requests += 1
        return chosen

    async def run(
        self,
        engines: Callable[[], Awaitable[set[str]]],
        load: Callable[[str, float], Awaitable[EngineLoad | None]],
        changed: Callable[[PaceVerdict, PaceVerdict], Awaitable[None]],
    ) -> None:
        """Read the engines (``engines()``: their URLs; ``load(url, timeout_s)``: one's load) every POLL_S,
        until cancelled (run it ``alongside`` generation); ``changed(before, after)`` is told each time the set
        of slow engines changes."""
        while True:
            try:
                urls = sorted(await engines())
            except EngineError:  # neither the router nor etcd answers: nothing to read this time
                urls = None
            if urls is not None:
                loads = await asyncio.gather(*(load(url, READ_TIMEOUT_S) for url in urls))
                before = self.verdict
                after = self.read(dict(zip(urls, loads)), time.monotonic())
                if before.slow(self.factor) != after.slow(self.factor):
                    await changed(before, after)
            await asyncio.sleep(POLL_S)
