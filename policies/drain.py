"""What a draining node's groups do next: leave on their own at a safe point, or be taken.

Pure. A node is drained (`erl drain`, erld's `--drain-on-term` on SIGTERM, a preemption notice) with a
deadline. Its groups leave in the order that loses nothing: each process is asked to leave
(``ASK``) and does so at its own safe point (an engine once its requests are done or the deadline
nears, a trainer replica after its rollout's last step, the orchestrator after its next commit); a
group whose processes all report ``drained`` has left (``LEFT``) and is placed elsewhere; a warm spare
holds no work and leaves at once. What has not left by the deadline is taken (``OVERDUE``) and
recovered as after a node death.

The router and the lighthouse have no safe point of their own: they leave with the orchestrator
(the services are one group), once it has committed and gone.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from policies.placement import GroupKind

DRAINED_STATE = "drained"
"""What an agent reports for a process that left a draining node at its safe point."""


class DrainStep(Enum):
    ASK = "ask"
    """Ask the group's processes to leave at their safe point, and wait."""
    LEFT = "left"
    """Every process left: place the group elsewhere."""
    OVERDUE = "overdue"
    """The deadline passed first: take the group as if the node had died."""


def drain_step(kind: GroupKind, states: Iterable[str | None], now: float, deadline: float) -> DrainStep:
    """The next step for one group on a draining node, from what its processes report (``states``: one
    per process, None for one not reported at its current assignment)."""
    states = list(states)
    if kind is GroupKind.SPARE or (states and all(state == DRAINED_STATE for state in states)):
        return DrainStep.LEFT
    if now >= deadline:
        return DrainStep.OVERDUE
    return DrainStep.ASK


def engine_may_stop(holds_work: bool | None, now: float, deadline: float, margin_s: float) -> bool:
    """Whether a draining engine, out of the router, stops now: once it holds no work (its requests
    finished), or when the deadline is ``margin_s`` away, so its orchestrator has that long to continue
    what it held on another engine. An engine that does not answer (None) holds nothing worth waiting for."""
    return not holds_work or now >= deadline - margin_s
