"""A straggling replica's response, decided by each of its ranks alike: leave for a replacement, or say so and train on.

``policies.straggler`` finds the straggler; every rank of the replica holds the same verdict (a replica's
time is its slowest rank's). Rank 0 asks etcd whether the job has somewhere to replace it and tells the
other ranks, so the whole replica leaves or stays together. The replica leaves at a safe point
(``trainer.replica``: after its step, and after publishing at a rollout's last step) with the exit code
``EXIT_STRAGGLED``: erld marks its devices failed in the device ledger and the controller moves the
replica, to a warm spare or free devices, or lets the job go on without it above its minimum. The
step it took part in is committed everywhere: the survivors' next quorum goes on without it and
nothing is redone.
"""

from __future__ import annotations

import asyncio
import os

import torch

from elastic_rl import jobenv
from elastic_rl.event_kinds import EventKind
from elastic_rl.events import emit_event
from elastic_rl.spec.job import JobSpec
from elastic_rl.store.client import Store, StoreUnavailable
from elastic_rl.store.devices import free_device_slots
from policies.straggler import StragglerAction, response


def has_somewhere_to_go(spec: JobSpec, participants: int) -> bool:
    """A warm spare, the job above its minimum of replicas, or a node with a replica's worth of free devices.

    etcd unreachable: no (a straggler trains on rather than leave on a guess)."""
    if spec.fault_tolerance.warm_spares > 0 or participants - 1 >= spec.trainer.replicas.min:
        return True

    async def free_room() -> bool:
        async with Store(os.environ[jobenv.ETCD], attempts=1) as store:
            free = await free_device_slots(store)
        return any(len(slots) >= spec.trainer.ranks_per_replica for slots in free.values())

    try:
        return asyncio.run(free_room())
    except StoreUnavailable:
        return False


def respond_to_straggling(
    spec: JobSpec, *, ratio: float, streak: int, participants: int, proc: str, device: str | None, step: int
) -> StragglerAction:
    """Every rank of the straggling replica calls this at the same step, and gets the same answer."""
    rank = torch.distributed.get_rank()
    answer = [has_somewhere_to_go(spec, participants) if rank == 0 else None]
    torch.distributed.broadcast_object_list(answer, src=0)
    action = response(replaceable=bool(answer[0]))
    if rank == 0:
        outcome = (
            "leaving for a replacement; its devices are marked failed"
            if action is StragglerAction.LEAVE
            else "no warm spare, no free devices and the job at its minimum: it trains on"
        )
        emit_event(
            EventKind.REPLICA_STRAGGLING,
            f"{ratio:.1f}x its peers' time per step for {streak} steps in a row; {outcome}",
            proc,
            device=device,
            step=step,
            ratio=ratio,
            slow_steps=streak,
            replaced=action is StragglerAction.LEAVE,
        )
    return action
