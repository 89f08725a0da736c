"""Job records in etcd as the CLI sees them: submit, read, stop. No torch, no processes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from checkpoints.discovery import newest_committed_snapshot
from checkpoints.rewind import rewind
from elastic_rl.config import JobSpec
from elastic_rl.errors import ElasticRLError
from elastic_rl.jobenv import committed_rollouts
from elastic_rl.store import keys
from elastic_rl.store.client import Store, StoreUnavailable

TERMINAL_PHASES = ("succeeded", "failed", "stopped")


class NoDaemon(ElasticRLError):
    """No erld answers at the endpoint."""


def no_daemon_message(endpoint: str) -> str:
    return (
        f"no erld is running at {endpoint}: start one with `erl daemon` (or `erl daemon --cpu-devices 4`), "
        f"or run a job end to end with `erl run SPEC`"
    )


async def require_daemon(store: Store) -> None:
    try:
        nodes = await store.get_prefix(keys.NODES)
    except StoreUnavailable:
        raise NoDaemon(no_daemon_message(store.endpoint)) from None
    if not nodes:
        raise NoDaemon(no_daemon_message(store.endpoint))


async def submit(store: Store, spec: JobSpec, workdir: Path) -> str:
    await require_daemon(store)
    job_id = spec.name
    existing = await store.get(keys.job_status(job_id))
    if existing is not None and existing.get("phase") not in TERMINAL_PHASES:
        raise ElasticRLError(f"job {job_id} is already {existing['phase']}; stop it first with `erl stop {job_id}`")
    workdir = workdir.resolve()
    if committed_rollouts(workdir):
        raise ElasticRLError(
            f"work dir {workdir} holds a previous run; give another with --workdir, or remove it"
        )
    await store.delete_prefix(keys.job(job_id))
    await store.put(keys.job_spec(job_id), spec.model_dump(mode="json"))
    await store.put(
        keys.job_status(job_id),
        {"phase": "pending", "workdir": str(workdir), "submitted": time.time(), "reason": ""},
    )
    return job_id


async def job_ids(store: Store) -> list[str]:
    found = await store.get_prefix(keys.JOBS)
    return sorted({keys.job_id_of(key) for key in found if key.endswith("/status")})


async def describe(store: Store, job_id: str, events: int = 10) -> dict[str, Any]:
    status = await store.get(keys.job_status(job_id))
    if status is None:
        raise ElasticRLError(f"no job {job_id!r}; `erl list` shows the jobs")
    spec = await store.get(keys.job_spec(job_id)) or {}
    procs = await store.get_prefix(keys.procs(job_id))
    found_events = await store.get_prefix(keys.events(job_id))
    workdir = Path(status["workdir"])
    snapshot = newest_committed_snapshot(workdir)
    log = committed_rollouts(workdir)
    return {
        "job": job_id,
        "status": status,
        "snapshot": None if snapshot is None else {"step": snapshot.step, "last_rollout": snapshot.last_rollout},
        "rollout_log": [log[0], log[-1]] if log else None,
        "num_rollouts": spec.get("rollout", {}).get("num_rollouts"),
        "progress": await store.get(keys.job_progress(job_id)) or {},
        "procs": {key.rsplit("/", 1)[1]: value for key, value in sorted(procs.items())},
        "events": [found_events[key] for key in sorted(found_events)[-events:]],
    }


async def resume(store: Store, job_id: str, snapshot_step: int | None = None) -> None:
    """Put a stopped or failed job back in the queue; its processes resume from the newest snapshot."""
    status = await store.get(keys.job_status(job_id))
    if status is None:
        raise ElasticRLError(f"no job {job_id!r}; `erl list` shows the jobs")
    if status.get("phase") not in ("stopped", "failed"):
        raise ElasticRLError(f"job {job_id} is {status.get('phase')}; only a stopped or failed job resumes")
    if snapshot_step is not None:
        last_rollout = rewind(Path(status["workdir"]), snapshot_step)
        progress = await store.get(keys.job_progress(job_id)) or {}
        await store.put(
            keys.job_progress(job_id),
            {**progress, "rollouts_done": last_rollout + 1, "weight_version": last_rollout + 1, "finished": False},
        )
    queued = {"phase": "pending", "reason": "", "resumed": time.time()}
    await store.modify(keys.job_status(job_id), lambda current: {**current, **queued})


async def stop(store: Store, job_id: str) -> str:
    status = await store.get(keys.job_status(job_id))
    if status is None:
        raise ElasticRLError(f"no job {job_id!r}; `erl list` shows the jobs")
    phase = status.get("phase")
    if phase in TERMINAL_PHASES:
        return phase
    new_phase = "stopped" if phase == "pending" else "stopping"
    await store.modify(keys.job_status(job_id), lambda current: {**current, "phase": new_phase, "reason": "stopped by request"})
    return new_phase


async def scale(store: Store, job_id: str, engines: int) -> int:
    """Set a job's engine count; erld adds or removes engines while the job runs. Returns the old count."""
    status = await store.get(keys.job_status(job_id))
    if status is None:
        raise ElasticRLError(f"no job {job_id!r}; `erl list` shows the jobs")
    if status.get("phase") in TERMINAL_PHASES:
        raise ElasticRLError(f"job {job_id} is {status.get('phase')}; only a pending or running job scales")
    spec = await store.get(keys.job_spec(job_id))
    old = status.get("engines", spec["engines"]["count"])
    # The spec follows, so a resumed job keeps the new count.
    await store.put(keys.job_spec(job_id), {**spec, "engines": {**spec["engines"], "count": engines}})
    await store.modify(keys.job_status(job_id), lambda current: {**current, "engines": engines})
    return old
