"""Job records in etcd as the CLI sees them: submit, read, stop. No torch, no processes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from checkpoints.discovery import newest_committed_snapshot
from checkpoints.layout import committed_rollouts, version_after
from checkpoints.rewind import rewind
from elastic_rl import job_secret
from elastic_rl.errors import ElasticRLError, InputError
from elastic_rl.event_kinds import EventKind
from elastic_rl.memory_plan import plan
from elastic_rl.spec.engines import DEFAULT_COUNT, EnginesSpec
from elastic_rl.spec.job import JobSpec
from elastic_rl.spec.loading import apply_overrides, parse_override, validate_spec
from elastic_rl.spec.placement import PlacementMode
from elastic_rl.spec.sizes import SizeRange, declared_sizes
from elastic_rl.spec.trainer import TrainerSpec
from elastic_rl.store import keys
from elastic_rl.store.client import Store, StoreUnavailable
from elastic_rl.store.devices import (
    all_assignments,
    assignment_slots,
    free_device_slots,
    job_statuses,
    ledger,
    live_nodes,
)
from elastic_rl.store.drains import drains, end_drain, start_drain
from elastic_rl.store.job_phase import ACTIVE_PHASES, RESUMABLE_PHASES, TERMINAL_PHASES, JobPhase
from policies.capacity import SIZED, OutOfRange, Size, current_sizes, rescale
from policies.devices import DeviceKind
from policies.memory import host_shortfall, slot_shortfall


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
    await _check_memory(store, spec)
    job_id = spec.name
    existing = await store.get(keys.job_status(job_id))
    if existing is not None and existing.get("phase") not in TERMINAL_PHASES:
        raise ElasticRLError(f"job {job_id} is already {existing['phase']}; stop it first with `erl stop {job_id}`")
    workdir = workdir.resolve()
    if committed_rollouts(workdir):
        raise ElasticRLError(f"work dir {workdir} holds a previous run; give another with --workdir, or remove it")
    if existing is not None:
        # A finished job of the same name stays listed (`erl list --all`).
        await store.put(
            keys.history(job_id, existing.get("submitted", 0.0)),
            {
                "job": job_id,
                "status": existing,
                "spec": await store.get(keys.job_spec(job_id)) or {},
                "progress": await store.get(keys.job_progress(job_id)) or {},
            },
        )
    await store.delete_prefix(keys.job(job_id))
    await store.delete_prefix(keys.events(job_id))
    await store.delete_prefix(keys.assignments(job_id))
    await store.put(keys.job_spec(job_id), spec.model_dump(mode="json"))
    await store.put(keys.job_secret(job_id), job_secret.make())
    await store.put(
        keys.job_status(job_id),
        {"phase": JobPhase.PENDING, "workdir": str(workdir), "submitted": time.time(), "reason": ""},
    )
    return job_id


async def _check_memory(store: Store, spec: JobSpec) -> None:
    """Refuse (``InputError``) a job whose trainer rank needs more memory than any node it could be placed
    on has per slot, where the nodes know it (GPUs through NVML, CPU nodes given `--slot-memory`), or,
    with its optimizer offloaded, more host memory than any such node has per slot."""
    nodes = await live_nodes(store)
    eligible = {
        name: info for name, info in nodes.items() if not spec.needs_cuda or info.get("kind") == DeviceKind.CUDA.value
    }
    slot_memory = {name: info.get("slot_memory") for name, info in eligible.items()}
    host_memory = {name: (info.get("host_memory"), info.get("devices") or 1) for name, info in eligible.items()}
    offloaded = spec.trainer.optimizer_offload
    if all(memory is None for memory in slot_memory.values()) and not offloaded:
        return  # nothing to check against: the plan, which reads the model's config, is not even made
    memory = plan(spec).memory
    shortfall = slot_shortfall(memory.total, slot_memory)
    if shortfall is not None:
        raise InputError(
            f"{spec.name}: {shortfall}. Split the model over more ranks (trainer.tensor_parallel, "
            "trainer.pipeline_parallel; a mixture of experts' experts: trainer.expert_parallel), or "
            "cut the activations (trainer.micro_batch_size or trainer.max_tokens_per_micro_batch, "
            "rollout.max_prompt_len); `erl plan SPEC` shows the bytes"
        )
    shortfall = host_shortfall(memory.host_bytes, host_memory) if offloaded else None
    if shortfall is not None:
        raise InputError(
            f"{spec.name}: {shortfall}. Shard the optimizer's state over more ranks (trainer.data_parallel "
            "with trainer.shard_optimizer), or keep it on the device (drop trainer.optimizer_offload); "
            "`erl plan SPEC` shows the bytes"
        )


async def secret_of(store: Store, job_id: str) -> str:
    """The job's secret (``elastic_rl.job_secret``), made here for a job submitted without one."""
    await store.create(keys.job_secret(job_id), job_secret.make())
    return await store.get(keys.job_secret(job_id))


async def history(store: Store) -> list[dict[str, Any]]:
    """Earlier jobs whose names were reused, oldest first, shaped like ``describe`` without processes."""
    records = await store.get_prefix(keys.HISTORY)
    return [
        {
            "job": record["job"],
            "status": record["status"],
            "progress": record["progress"],
            "num_rollouts": record["spec"].get("rollout", {}).get("num_rollouts"),
        }
        for record in sorted(records.values(), key=lambda record: record["status"].get("submitted", 0.0))
    ]


async def job_ids(store: Store) -> list[str]:
    found = await store.get_prefix(keys.JOBS)
    return sorted({keys.job_id_of(key) for key in found if key.endswith("/status")})


async def describe(store: Store, job_id: str, events: int = 10) -> dict[str, Any]:
    status = await store.get(keys.job_status(job_id))
    if status is None:
        raise ElasticRLError(f"no job {job_id!r}; `erl list` shows the jobs")
    spec = await store.get(keys.job_spec(job_id)) or {}
    reported = {keys.last_part(k): v for k, v in (await store.get_prefix(keys.procs(job_id))).items()}
    assigned = {keys.last_part(k): v for k, v in (await store.get_prefix(keys.assignments(job_id))).items()}
    # An assigned process its agent has not reported (yet, or its node is gone) shows as assigned.
    procs = {
        name: reported.get(name)
        or {
            "state": "assigned",
            "node": assignment["node"],
            "device": assignment.get("device"),
            "pid": None,
            "restarts": 0,
        }
        for name, assignment in assigned.items()
    }
    procs.update({name: record for name, record in reported.items() if name not in procs})
    found_events = [event for _, event in sorted((await store.get_prefix(keys.events(job_id))).items())]
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
        "procs": dict(sorted(procs.items())),
        "slots": slot_holders(assigned),
        "events": found_events[-events:],
        "stragglers": [event for event in found_events if event["kind"] == EventKind.REPLICA_STRAGGLING],
    }


def slot_holders(assigned: dict[str, dict]) -> dict[str, list[str]]:
    """``<node>/<slot>`` -> the job's processes assigned to it (colocated: a trainer rank and an engine)."""
    holders: dict[str, list[str]] = {}
    for name, assignment in sorted(assigned.items()):
        for slot in assignment_slots(assignment):
            holders.setdefault(f"{assignment['node']}/{slot}", []).append(name)
    return dict(sorted(holders.items()))


async def resume(store: Store, job_id: str, snapshot_step: int | None = None, layout: list[str] = ()) -> None:
    """Put a stopped, failed or paused job back in the queue; its processes resume from the newest
    snapshot (a paused job waits, pending, for room for its minimum, as it would have by itself).
    ``layout``: ``--set`` overrides of the replica layout (``RESHARDABLE``), which a snapshot loads into."""
    status = await store.get(keys.job_status(job_id))
    if status is None:
        raise ElasticRLError(f"no job {job_id!r}; `erl list` shows the jobs")
    if status.get("phase") not in RESUMABLE_PHASES:
        raise ElasticRLError(f"job {job_id} is {status.get('phase')}; only a stopped, failed or paused job resumes")
    if layout:
        await store.put(keys.job_spec(job_id), await _relaid(store, job_id, layout))
    if snapshot_step is not None:
        last_rollout = rewind(Path(status["workdir"]), snapshot_step)
        progress = await store.get(keys.job_progress(job_id)) or {}
        await store.put(
            keys.job_progress(job_id),
            {
                **progress,
                "rollouts_done": last_rollout + 1,
                "weight_version": version_after(last_rollout),
                "finished": False,
            },
        )
    # Every process starts afresh: engines given up before are back, the job is no longer degraded.
    queued = {"phase": JobPhase.PENDING, "reason": "", "resumed": time.time(), "degraded": []}
    await store.modify(keys.job_status(job_id), lambda current: {**current, **queued})


RESHARDABLE = (
    "trainer.tensor_parallel",
    "trainer.context_parallel",
    "trainer.pipeline_parallel",
    "trainer.data_parallel",
    "trainer.expert_parallel",
    "trainer.shard_optimizer",
    "trainer.optimizer_offload",
)
"""What `erl resume --set` may change: the replica's layout (and where its optimizer's state lives), which
every snapshot loads into."""


def check_reshardable(overrides: list[str]) -> None:
    """Refuse (``InputError``) a `erl resume --set` of anything but the replica layout."""
    for text in overrides:
        field = ".".join(parse_override(text)[0])
        if field not in RESHARDABLE:
            raise InputError(
                f"erl resume --set {text}: only the replica layout changes on resume ({', '.join(RESHARDABLE)}); "
                "for anything else submit the job again with a new work dir"
            )


async def _relaid(store: Store, job_id: str, overrides: list[str]) -> dict[str, Any]:
    """The job's spec with its replica layout changed, validated as a whole (``SpecError``, exit 2)."""
    check_reshardable(overrides)
    spec = validate_spec(apply_overrides(await store.get(keys.job_spec(job_id)), overrides), source=f"job {job_id}")
    return spec.model_dump(mode="json")


async def stop(store: Store, job_id: str) -> str:
    status = await store.get(keys.job_status(job_id))
    if status is None:
        raise ElasticRLError(f"no job {job_id!r}; `erl list` shows the jobs")
    phase = status.get("phase")
    if phase in TERMINAL_PHASES:
        return phase
    new_phase = JobPhase.STOPPED if phase in (JobPhase.PENDING, JobPhase.PAUSED) else JobPhase.STOPPING
    await store.modify(
        keys.job_status(job_id), lambda current: {**current, "phase": new_phase, "reason": "stopped by request"}
    )
    return new_phase


async def scale(store: Store, job_id: str, asked: dict[str, int | tuple[int, int]]) -> dict[str, tuple[Size, Size]]:
    """Change a running job's replicas or engines: ``asked`` maps "replicas" or "engines" to a number to
    pin within the kind's range, or a (MIN, MAX) range; returns each kind's size before and after.

    A number outside the range, replicas above the most the job was submitted for (that many size
    each step's verdicts), and a minimum the cluster's free device slots cannot hold are refused
    (``InputError``): the record holds only what is real or about to be.
    """
    status = await store.get(keys.job_status(job_id))
    if status is None:
        raise ElasticRLError(f"no job {job_id!r}; `erl list` shows the jobs")
    if status.get("phase") != JobPhase.RUNNING:
        raise ElasticRLError(f"job {job_id} is {status.get('phase')}; only a running job scales")
    # Read, not validated again: this machine may lack what the job's nodes have (SGLang, data files).
    raw = await store.get(keys.job_spec(job_id))
    if "engines" in asked and raw.get("placement") == PlacementMode.COLOCATED.value:
        raise InputError(
            f"job {job_id} is colocated: its engines share its replicas' devices and follow them; "
            "scale it with --replicas"
        )
    engines = raw["engines"].get("count")
    declared = declared_sizes(
        SizeRange.model_validate(raw["trainer"]["replicas"]),
        DEFAULT_COUNT if engines is None else SizeRange.model_validate(engines),
        bool(raw["debug"].get("rollout_only")),
        raw["debug"].get("train_only") is not None,
    )
    sizes = current_sizes(declared, status.get("sizes", {}))
    changed = {}
    for kind, name in SIZED.items():
        if name not in asked:
            continue
        try:
            after = rescale(sizes[kind], asked[name], declared["replicas"][1] if name == "replicas" else None)
        except OutOfRange as exc:
            raise InputError(f"job {job_id}: --{name} {exc}; give --{name} MIN:MAX for a new range") from exc
        changed[name] = (sizes[kind], after)
    await _room_for(store, job_id, raw, {name: after.bounds[0] for name, (_, after) in changed.items()})
    recorded = {name: [after.least, after.most, after.pinned] for name, (_, after) in changed.items()}
    await store.modify(
        keys.job_status(job_id), lambda current: {**current, "sizes": {**current.get("sizes", {}), **recorded}}
    )
    return changed


async def _room_for(store: Store, job_id: str, raw: dict, minimums: dict[str, int]) -> None:
    """Refuse a minimum above what the job holds that the free device slots cannot hold."""
    held_names = [keys.last_part(key) for key in await store.get_prefix(keys.assignments(job_id))]
    held = {
        "engines": sum(1 for name in held_names if name.startswith("engine-")),
        "replicas": sum(1 for name in held_names if name.startswith("trainer-") and name.endswith("-0")),
    }
    per_group = {
        "engines": EnginesSpec.model_construct(**raw["engines"]).slots,
        "replicas": TrainerSpec.model_construct(**raw["trainer"]).ranks_per_replica,
    }
    free_slots = None
    for name, least in minimums.items():
        if least <= held[name]:
            continue
        if free_slots is None:
            free_slots = await free_device_slots(store, await job_statuses(store))
        per = per_group[name]
        room = sum(len(slots) // per for slots in free_slots.values())
        if room < least - held[name]:
            raise InputError(
                f"job {job_id} runs {held[name]} {name}; {least} need {(least - held[name]) * per} more device "
                f"slots ({per} on one node each) and the cluster has room for {room} more: ask for at most "
                f"{held[name] + room}, or free devices"
            )


async def drain(store: Store, node: str, deadline_s: float) -> dict[str, Any]:
    """Start draining a live node (`erl drain`): its job processes leave by the deadline."""
    nodes = await live_nodes(store)
    if node not in nodes:
        raise InputError(f"erl drain: no live node {node!r}; the nodes are {', '.join(sorted(nodes)) or 'none'}")
    if deadline_s <= 0:
        raise InputError(f"erl drain: --deadline {deadline_s:g} is not a time: give seconds, more than 0")
    return await start_drain(store, node, deadline_s, "erl drain")


async def undrain(store: Store, node: str) -> None:
    """End a node's drain (`erl undrain`): it takes new processes again."""
    if not await end_drain(store, node):
        raise InputError(f"erl undrain: node {node!r} is not draining; `erl nodes` shows which are")


async def describe_nodes(store: Store) -> dict[str, Any]:
    """The cluster as `erl nodes` shows it: the leader, and per live node its device slots (free, in use
    by which process, or failed and why), the job processes placed there without a slot, and its drain
    (deadline, and whether nothing is left there) if it is draining."""
    statuses = await job_statuses(store)
    assignments = await all_assignments(store)
    failed = await ledger(store)
    draining = await drains(store)
    nodes = []
    for name, info in sorted((await live_nodes(store)).items()):
        holders: dict[int, str] = {}
        slotless = []
        for job_id, procs in assignments.items():
            if statuses.get(job_id, {}).get("phase") not in ACTIVE_PHASES:
                continue
            for proc, assignment in sorted(procs.items()):
                if assignment["node"] != name:
                    continue
                slots = assignment_slots(assignment)
                if not slots:
                    slotless.append(f"{job_id}/{proc}")
                for slot in slots:  # colocated, a trainer rank and an engine share a slot
                    holders[slot] = ", ".join(filter(None, (holders.get(slot), f"{job_id}/{proc}")))
        devices = []
        for index in range(info["devices"]):
            entry = failed.get(keys.ledger_entry(name, index))
            if entry is not None and (entry.get("until") is None or entry["until"] > time.time()):
                devices.append(
                    {"device": index, "state": "failed", "reason": entry.get("reason"), "until": entry.get("until")}
                )
            else:
                devices.append(
                    {"device": index, "state": "in use" if index in holders else "free", "proc": holders.get(index)}
                )
        drain = draining.get(name)
        if drain is not None:
            drain = {**drain, "drained": not holders and not slotless}
        nodes.append(
            {
                "node": name,
                "advertise_host": info.get("advertise_host"),
                "pid": info.get("pid"),
                "slot_memory": info.get("slot_memory"),
                "host_memory": info.get("host_memory"),
                "devices": devices,
                "procs_without_device": slotless,
                "drain": drain,
            }
        )
    return {"leader": await store.get(keys.LEADER), "nodes": nodes}
