"""Dynamic sampling's decisions: which generated groups a rollout keeps, and when bad data has gone
on long enough to fail the job. Pure: rewards and counts in, a decision out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def zero_std(rewards: Sequence[float]) -> bool:
    """Keep a group unless its rewards are all equal (DAPO): such a group has no advantage to learn from."""
    return len(set(rewards)) > 1


@dataclass
class ConsecutiveFailures:
    """A failure budget: spent once ``limit`` failures come in a row; a success starts it afresh."""

    limit: int
    count: int = 0

    def record(self, failed: bool) -> bool:
        """Count one outcome; True when the budget is spent."""
        self.count = self.count + 1 if failed else 0
        return self.count >= self.limit
