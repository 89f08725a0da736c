"""Whether an engine is healthy, from its recent health checks.

Pure: the outcome of the newest ``/health_generate`` check and the failures
before it in, a verdict out. A check fails when it errors, answers non-200,
or takes longer than its timeout (a hung engine, e.g. SIGSTOPped, answers
nothing at all). ``failure_threshold`` failures in a row make the engine
unhealthy; any success clears the count. A process that has exited is
unhealthy at once, whatever its checks said.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealthVerdict:
    unhealthy: bool
    consecutive_failures: int
    reason: str = ""


def judge(check_ok: bool, consecutive_failures: int, failure_threshold: int, error: str = "") -> HealthVerdict:
    """``consecutive_failures``: failed checks in a row before this one."""
    if check_ok:
        return HealthVerdict(False, 0)
    failures = consecutive_failures + 1
    if failures >= failure_threshold:
        return HealthVerdict(True, failures, f"{failures} failed health check(s) in a row, the last: {error}")
    return HealthVerdict(False, failures)

