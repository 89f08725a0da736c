"""When a job process exits unexpectedly: restart it after a backoff, or give up.

Pure: the exit history in, a decision out. A process may restart ``max_restarts``
times within any ``window_s``. The first exit in the window restarts at once:
a lone fault costs a fork (or a pre-imported interpreter), not a wait. Each
further restart in the window waits, from ``base_delay_s`` doubling up to
``max_delay_s``, so a process that keeps crashing backs off. One more exit in
the window and the job fails with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    window_s: float
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    delay_s: float = 0.0
    reason: str = ""


def decide_restart(policy: RestartPolicy, restarts: list[float], now: float) -> RestartDecision:
    """``restarts``: times of this process's earlier restarts; ``now``: time of the new exit."""
    recent = [t for t in restarts if now - t <= policy.window_s]
    if len(recent) >= policy.max_restarts:
        return RestartDecision(
            restart=False,
            reason=f"exited {len(recent) + 1} times within {policy.window_s:.0f}s "
            f"(restart budget {policy.max_restarts})",
        )
    delay = min(policy.max_delay_s, policy.base_delay_s * 2 ** (len(recent) - 1)) if recent else 0.0
    return RestartDecision(restart=True, delay_s=delay)
