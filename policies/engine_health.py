"""Whether an engine is hung, told apart from an engine that is only slow.

Pure: what the newest check saw and what was remembered of the engine in, a
verdict out. A check reads the engine's load (``/metrics``): its progress
counter (tokens generated plus requests finished) and whether it holds work
(requests running or queued), within the check's timeout.

A check is evidence of life when the engine answered and either holds no
work or has advanced its counter since the last evidence. An engine is
unhealthy when it has shown no evidence of life for ``hang_timeout_s``: it
answered nothing for that long (hung, e.g. SIGSTOPped, or gone), or it held
work and made no progress for that long (a wedged generator). A late or
missing answer from an engine whose counter goes on advancing is load, never
a fault: a slowdown shared by every engine then restarts none of them, and
the rule is the same with one engine or many. The timeout is long enough to
cover a weight load, during which an engine holds its requests.

(A process that has exited needs no verdict: erld replaces it at once.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    """What one answered check read of an engine."""

    progress: int
    """Tokens generated plus requests finished since the engine started: only ever grows."""
    holding_work: bool
    """Requests running or queued."""
    generated_tokens: int = 0
    """Tokens generated since the engine started (the token part of ``progress``)."""
    running_requests: float = 0.0
    """Requests in the running batch at the read (queued ones not counted)."""


@dataclass(frozen=True)
class EngineWatch:
    """What is remembered of an engine between checks."""

    last_alive: float
    """When the engine last showed evidence of life (or started serving)."""
    progress: int | None = None
    """Its counter at the last answer; None before the first."""
    answered: bool = True
    """Whether the last check got an answer."""


@dataclass(frozen=True)
class HealthVerdict:
    unhealthy: bool
    watch: EngineWatch
    reason: str = ""


def judge(watch: EngineWatch, load: EngineLoad | None, now: float, hang_timeout_s: float) -> HealthVerdict:
    """``load``: what this check read, None when the engine answered nothing within the check's timeout."""
    if load is not None:
        advanced = watch.progress is not None and load.progress > watch.progress
        alive = not load.holding_work or advanced
        watch = EngineWatch(now if alive else watch.last_alive, load.progress, answered=True)
    else:
        watch = EngineWatch(watch.last_alive, watch.progress, answered=False)
    silent_s = now - watch.last_alive
    if silent_s < hang_timeout_s:
        return HealthVerdict(False, watch)
    if watch.answered:
        reason = f"it held work and generated nothing for {silent_s:.0f} s (engines.hang_timeout_s {hang_timeout_s:g})"
    else:
        reason = (
            f"it answered nothing and generated nothing for {silent_s:.0f} s "
            f"(engines.hang_timeout_s {hang_timeout_s:g}): hung or gone"
        )
    return HealthVerdict(True, watch, reason)
