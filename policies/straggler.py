"""When a trainer replica is a straggler, and whether to replace it.

Pure: every replica's own time for one step in, a verdict out. A synchronous
step goes at the pace of its slowest replica, so one slow device holds every
replica back. Each replica measures its own time per step outside the
all-reduce (its forward and backward passes: what a slow device slows), and the
step's all-reduce carries every replica's time to every other, so every replica
reaches the same verdict without talking further.

- In a step, a replica is slow when its time is at least ``factor`` times the
  median of its peers' times (the step's other replicas) and at least
  ``MIN_EXCESS_S`` more. It is measured against its peers, never against a
  fixed time: when every replica is slow (a longer batch, a host under load),
  none is slower than its peers and none is a straggler. That is the overload
  rule: slowness everywhere is not a fault.
- A replica slow in ``steps`` committed steps in a row is a straggler. A step at
  its peers' pace ends its run of slow steps, and so does a step it took no part
  in. With a single replica there is nobody to compare with.
- A straggler is replaced (it leaves, its device is marked failed, and a warm
  spare or a free device takes its place, or the job goes on smaller) only when
  the job has somewhere to go: a spare, a free device, or room above its
  minimum of replicas. Otherwise it trains on: slow beats paused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from statistics import median

MIN_EXCESS_S = 0.05
"""Below this much more than its peers' median, a step's difference is timer and scheduler noise, whatever
the ratio: a 20 ms step against a 9 ms one says nothing about the device."""


@dataclass(frozen=True, kw_only=True)
class StragglerRule:
    factor: float
    """A replica this many times slower than its peers' median in a step is slow in that step."""
    steps: int
    """Slow this many committed steps in a row: a straggler."""


@dataclass(frozen=True)
class StragglerVerdict:
    streaks: dict[int, int]
    """Replica -> its slow steps in a row, this step included (only the slow ones appear)."""
    stragglers: frozenset[int]
    """Replicas slow for the rule's steps in a row."""
    ratios: dict[int, float]
    """Replica -> its time over the median of its peers' in this step (``peer_ratios``)."""

    @property
    def ratio(self) -> float:
        """The largest ratio of the step; 1.0 with a single replica."""
        return max(self.ratios.values(), default=1.0)


class StragglerAction(Enum):
    LEAVE = "leave"
    """A straggler with somewhere to go: it leaves, so that its place is taken elsewhere."""
    REPORT = "report"
    """A straggler the job has nowhere to replace now: it says so and trains on."""


def peer_ratios(times: Mapping[int, float]) -> dict[int, float]:
    """Each replica's time over the median of the others' times (none with a single replica).

    A replica whose time exceeds its peers' by less than ``MIN_EXCESS_S`` counts as 1.0: noise."""
    ratios = {}
    for replica, time in times.items():
        peers = [other for peer, other in times.items() if peer != replica]
        if not peers:
            continue
        usual = median(peers)
        ratios[replica] = time / usual if time - usual >= MIN_EXCESS_S and usual > 0 else 1.0
    return ratios


def judge(times: Mapping[int, float], streaks: Mapping[int, int], rule: StragglerRule) -> StragglerVerdict:
    """One committed step: ``times`` of the replicas that took part, ``streaks`` as the last step left them."""
    ratios = peer_ratios(times)
    slow = {replica for replica, ratio in ratios.items() if ratio >= rule.factor}
    after = {replica: streaks.get(replica, 0) + 1 for replica in slow}
    return StragglerVerdict(
        streaks=after,
        stragglers=frozenset(replica for replica, count in after.items() if count >= rule.steps),
        ratios=ratios,
    )


def due(streak: int, rule: StragglerRule) -> bool:
    """Whether a straggler acts at this slow step: when its run of slow steps reaches the rule's, and every
    ``steps`` slow steps after that (a straggler that could not be replaced asks again)."""
    return streak >= rule.steps and (streak - rule.steps) % rule.steps == 0


def response(*, replaceable: bool) -> StragglerAction:
    """``replaceable``: a warm spare, a free device, or the job above its minimum of replicas."""
    return StragglerAction.LEAVE if replaceable else StragglerAction.REPORT
