"""How a rollout's requests are shared among engines when one generates well below its peers' pace.

Pure: each engine's measured pace in, each engine's share of new requests out.
An engine's pace is the tokens it generates per second per request it runs
(``engines.pace``): per request, so that an engine given fewer requests is not
judged slower for it.

- An engine is slow when its peers' median pace (the other engines') is at
  least ``factor`` times its own. It is measured against its peers, never
  against a fixed rate: when every engine is slow (long prompts, a loaded
  host), none is slower than its peers. That is the overload rule: slowness
  everywhere is not a fault, and no engine is ever restarted for being slow.
- While no engine is slow, requests are shared evenly, as the router shares
  them. Once one is, every engine's share is in proportion to its pace, so a
  quarter-speed engine gets about a quarter of a peer's requests. When the
  engines hold more requests than they run at once (a large rollout), that
  lets every engine finish its queue at about the same time. A request an
  engine runs still takes as long as its pace makes it: a rollout that fits in
  the engines' running batches still waits for the slow engine's last one.
- An engine whose pace is not known yet (just started, or idle for the whole
  window) counts at its peers' median: it gets a full share until it is
  measured. So an engine that has recovered is measured again and taken back
  at full share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True)
class PaceVerdict:
    shares: dict[str, float] | None
    """Engine -> its share of new requests (they sum to 1); None: shared evenly, as the router does."""
    ratios: dict[str, float]
    """Engine -> its pace over the median of its peers' paces (engines with a known pace and peers)."""

    @property
    def slowest(self) -> float:
        """The lowest ratio: 1.0 when no engine can be compared."""
        return min(self.ratios.values(), default=1.0)

    def slow(self, factor: float) -> list[str]:
        """The engines at least ``factor`` times slower than their peers."""
        return sorted(engine for engine, ratio in self.ratios.items() if ratio * factor <= 1.0)


EVEN = PaceVerdict(None, {})


def judge(paces: Mapping[str, float | None], factor: float | None) -> PaceVerdict:
    """Each engine's share of new requests, from its pace (None: not measured yet).

    ``factor``: how many times slower than its peers' median an engine is slow (None: never)."""
    known = {engine: pace for engine, pace in paces.items() if pace is not None}
    if factor is None or len(known) < 2:
        return EVEN
    ratios = {}
    for engine, pace in known.items():
        peers = median(other for peer, other in known.items() if peer != engine)
        if peers > 0:
            ratios[engine] = pace / peers
    verdict = PaceVerdict(None, ratios)
    if not verdict.slow(factor):
        return verdict
    usual = median(known.values())
    filled = {engine: usual if pace is None else pace for engine, pace in paces.items()}
    total = sum(filled.values())
    return PaceVerdict({engine: pace / total for engine, pace in filled.items()}, ratios)
