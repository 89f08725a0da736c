"""Whether an engine is healthy, from its newest health check and the ones before it.

Pure: one check's outcome and the failures before it in, a verdict out. A
check asks for a generation (``/health_generate``) and, at the same time,
whether the server answers at all (``/health``), each within the timeout.

- The generation came back: healthy; the failure count clears.
- Neither came back: the engine is hung or gone (a SIGSTOPped process answers
  nothing): unhealthy at once, so a hang is found within interval + timeout.
- The server answers but the generation failed or was late: an overloaded or
  wedged generator. This counts as a failure; ``failure_threshold`` in a row
  make the engine unhealthy, since a busy engine's health generation can queue
  behind real requests, and an engine's waits while it loads new weights.

(A process that has exited needs no verdict: erld replaces it at once.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealthVerdict:
    unhealthy: bool
    consecutive_failures: int
    reason: str = ""


def judge(generated: bool, responsive: bool, consecutive_failures: int, failure_threshold: int) -> HealthVerdict:
    """``consecutive_failures``: failed checks in a row before this one."""
    if generated:
        return HealthVerdict(False, 0)
    failures = consecutive_failures + 1
    if not responsive:
        return HealthVerdict(True, failures, "the server answered nothing within the timeout (hung or dead)")
    if failures >= failure_threshold:
        return HealthVerdict(
            True, failures, f"{failures} health generations in a row failed or were late while the server answered"
        )
    return HealthVerdict(False, failures)
