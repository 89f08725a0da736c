"""The etcd key layout, in one place.

    /erl/nodes/<node>                      a live erld: host, advertise host, pid, device count
                                           (bound to its node lease)
    /erl/leader                            the controller's node name (bound to its lease); every
                                           controller write is conditional on it being unchanged
    /erl/devices/<node>/<device>           a device slot of a live node (bound to the node lease)
    /erl/drain/<node>                      a node being drained: deadline, since, by whom (no lease when
                                           `erl drain` set it, until `erl undrain`; the node lease when
                                           erld set it on SIGTERM, so it ends with the node)
    /erl/ledger/<node>/<device>            a device marked failed: reason, since, until (no lease:
                                           it outlives erld until `erl devices reset` or its cool-down)
    /erl/jobs/<job>/spec                   the validated job spec (JSON)
    /erl/jobs/<job>/status                 phase (pending, running, stopping, stopped, succeeded,
                                           failed), reason, work dir, times, wanted engine count
    /erl/jobs/<job>/progress               rollout, weight version, reward: from the orchestrator
    /erl/jobs/<job>/procs/<proc>           a running job process as its agent reports it: node,
                                           state, pid, port, device, generation, restarts (bound
                                           to the agent's node lease)
    /erl/jobs/<job>/hung/<proc>            colocated: an engine that did not release its memory within
                                           fault_tolerance.handover_timeout_s, as the orchestrator found
                                           it: its pid and why; its agent replaces it and deletes the key
    /erl/assign/<job>/<proc>               the controller's assignment of a process: node, device
                                           slots, port, generation; an agent runs exactly what is
                                           assigned to its node, at the generation assigned
    /erl/placed/<node>/<job>               the names of the job's processes assigned to the node: an
                                           index the leader keeps from the assignments, so that an
                                           agent follows only the jobs on its own node
    /erl/events/<job>/<seq>                an event: time, kind, process, node, message
    /erl/history/<job>/<submitted>         an earlier, finished job of that name: its status,
                                           progress and spec, kept when the name is reused

Values are JSON. Small coordinating facts only: bulk data lives in the job's work dir.
"""

from __future__ import annotations

ROOT = "/erl"
NODES = f"{ROOT}/nodes/"
LEADER = f"{ROOT}/leader"
JOBS = f"{ROOT}/jobs/"
DEVICES = f"{ROOT}/devices/"
LEDGER = f"{ROOT}/ledger/"
DRAINS = f"{ROOT}/drain/"
ASSIGN = f"{ROOT}/assign/"
PLACED = f"{ROOT}/placed/"
EVENTS = f"{ROOT}/events/"
HISTORY = f"{ROOT}/history/"


def node(name: str) -> str:
    return f"{NODES}{name}"


def devices(node_name: str) -> str:
    return f"{DEVICES}{node_name}/"


def device(node_name: str, index: int) -> str:
    return f"{devices(node_name)}{index}"


def drain(node_name: str) -> str:
    return f"{DRAINS}{node_name}"


def ledger_entry(node_name: str, index: int) -> str:
    return f"{LEDGER}{node_name}/{index}"


def job(job_id: str) -> str:
    return f"{JOBS}{job_id}/"


def job_spec(job_id: str) -> str:
    return f"{job(job_id)}spec"


def job_status(job_id: str) -> str:
    return f"{job(job_id)}status"


def job_secret(job_id: str) -> str:
    return f"{job(job_id)}secret"


def job_progress(job_id: str) -> str:
    return f"{job(job_id)}progress"


def procs(job_id: str) -> str:
    return f"{job(job_id)}procs/"


def proc(job_id: str, name: str) -> str:
    return f"{procs(job_id)}{name}"


def hung_reports(job_id: str) -> str:
    return f"{job(job_id)}hung/"


def hung_report(job_id: str, name: str) -> str:
    return f"{hung_reports(job_id)}{name}"


def assignments(job_id: str) -> str:
    return f"{ASSIGN}{job_id}/"


def assignment(job_id: str, name: str) -> str:
    return f"{assignments(job_id)}{name}"


def placed_on(node_name: str) -> str:
    return f"{PLACED}{node_name}/"


def placement(node_name: str, job_id: str) -> str:
    return f"{placed_on(node_name)}{job_id}"


def events(job_id: str) -> str:
    return f"{EVENTS}{job_id}/"


def event(job_id: str, sequence: int) -> str:
    return f"{events(job_id)}{sequence:012d}"


def history(job_id: str, submitted: float) -> str:
    return f"{HISTORY}{job_id}/{submitted:.6f}"


def job_id_of(key: str) -> str:
    """The job id in a key under /erl/jobs/, /erl/assign/ or /erl/events/."""
    for prefix in (JOBS, ASSIGN, EVENTS):
        if key.startswith(prefix):
            return key[len(prefix) :].split("/", 1)[0]
    raise ValueError(f"{key} is not a job's key")


def last_part(key: str) -> str:
    return key.rsplit("/", 1)[1]
