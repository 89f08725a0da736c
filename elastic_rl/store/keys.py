"""The etcd key layout, in one place.

    /erl/nodes/<node>                      a live erld (bound to its lease)
    /erl/leader                            the controller's node name (bound to its lease)
    /erl/devices/<node>/<device>           a device slot and its state
    /erl/jobs/<job>/spec                   the validated job spec (JSON)
    /erl/jobs/<job>/status                 phase (pending, running, stopping, stopped,
                                           succeeded, failed), reason, node, times
    /erl/jobs/<job>/progress               rollout, weight version, reward: from the orchestrator
    /erl/jobs/<job>/procs/<proc>           a job process: state, pid, port, restarts (lease)
    /erl/jobs/<job>/events/<seq>           an event: time, kind, process, message

Values are JSON. Small coordinating facts only: bulk data lives in the job's work dir.
"""

from __future__ import annotations

ROOT = "/erl"
NODES = f"{ROOT}/nodes/"
LEADER = f"{ROOT}/leader"
JOBS = f"{ROOT}/jobs/"
DEVICES = f"{ROOT}/devices/"


def node(name: str) -> str:
    return f"{NODES}{name}"


def devices(node_name: str) -> str:
    return f"{DEVICES}{node_name}/"


def device(node_name: str, index: int) -> str:
    return f"{devices(node_name)}{index}"


def job(job_id: str) -> str:
    return f"{JOBS}{job_id}/"


def job_spec(job_id: str) -> str:
    return f"{job(job_id)}spec"


def job_status(job_id: str) -> str:
    return f"{job(job_id)}status"


def job_progress(job_id: str) -> str:
    return f"{job(job_id)}progress"


def procs(job_id: str) -> str:
    return f"{job(job_id)}procs/"


def proc(job_id: str, name: str) -> str:
    return f"{procs(job_id)}{name}"


def events(job_id: str) -> str:
    return f"{job(job_id)}events/"


def event(job_id: str, sequence: int) -> str:
    return f"{events(job_id)}{sequence:012d}"


def job_id_of(key: str) -> str:
    """The job id in a key under /erl/jobs/."""
    return key[len(JOBS) :].split("/", 1)[0]
