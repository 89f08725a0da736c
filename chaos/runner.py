"""Runs a job on a topology, injecting faults on schedule: the one fault loop the tests, benchmarks and
`erl chaos run` share.

``run_job`` submits a job spec to a running topology and follows it to its
end, injecting each fault when its moment comes (a rollout count, a time, or
a predicate of the work dir) a random part of a second late, so faults land
anywhere in a rollout. A fault whose target is not running yet (the job is
between a stop and its resume, a process is restarting) waits for it, up to
``TARGET_WAIT_S``. A fault is a ``chaos.scenario.Fault``, or any action as a
function. It returns what was injected.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from chaos.erl_cli import erl, job_status
from chaos.faults import Injection, NoTarget, inject
from chaos.scenario import Fault
from chaos.topology import Topology
from checkpoints import inflight_log, layout
from elastic_rl.spec.loading import load_spec
from elastic_rl.store.job_phase import LEAVING_PHASES, JobPhase

Moment = int | float | Callable[[Path], bool]
"""A rollout count, or a predicate of the work dir (e.g. "a replica has healed")."""
Action = Fault | Callable[[], None]
UNFINISHED = (JobPhase.PENDING, JobPhase.RUNNING, *LEAVING_PHASES, JobPhase.PAUSED)
"""The phases of a job that has not ended: a paused one resumes by itself when its minimum fits."""

TARGET_WAIT_S = 60.0


@dataclass
class JobRun:
    workdir: Path
    job: str
    status: dict
    injections: list[Injection] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


def logged(proc: str, text: str) -> Callable[[Path], bool]:
    """A moment: the log of the job's process ``proc`` holds ``text``."""

    def moment(workdir: Path) -> bool:
        path = layout.proc_log_path(workdir, proc)
        return path.is_file() and text in path.read_text(errors="replace")

    return moment


def generating(rollout_id: int) -> Callable[[Path], bool]:
    """A moment: the orchestrator has begun generating rollout ``rollout_id``."""
    return logged("orchestrator", f"rollout {rollout_id}: generating with weights")


def streamed(rollout_id: int, tokens: int) -> Callable[[Path], bool]:
    """A moment: rollout ``rollout_id``'s samples have streamed ``tokens`` tokens in all (its in-flight log
    holds them), and some are still generating."""

    def moment(workdir: Path) -> bool:
        samples = inflight_log.read(workdir, rollout_id)
        made = sum(len(sample.output_ids) for sample in samples.values())
        return made >= tokens and any(sample.status is None for sample in samples.values())

    return moment


CLOSE_LOOK_S = 0.005


def training(rollout_id: int) -> Callable[[Path], bool]:
    """A moment: rollout ``rollout_id`` is committed and the trainers have not published its weights yet.
    A small job trains a rollout in well under a second, so once the rollout before it is committed the
    work dir is watched closely (every CLOSE_LOOK_S) until that turn comes, or goes by unseen."""

    def in_turn(workdir: Path) -> bool:
        committed = layout.rollout_dir(workdir, rollout_id).is_dir()
        return committed and not layout.train_metrics_path(workdir, rollout_id).is_file()

    def moment(workdir: Path) -> bool:
        if rollout_id > 0 and not layout.rollout_dir(workdir, rollout_id - 1).is_dir():
            return False
        while not layout.train_metrics_path(workdir, rollout_id).is_file():
            if in_turn(workdir):
                return True
            time.sleep(CLOSE_LOOK_S)
        return False

    return moment


def _due(moment: Moment, workdir: Path, rollouts_done: int, elapsed: float) -> bool:
    if callable(moment):
        return moment(workdir)
    if isinstance(moment, float):
        return elapsed >= moment
    return rollouts_done >= moment


def _inject(action: Action, topology: Topology, job: str, workdir: Path, rng: random.Random | None) -> Injection:
    if isinstance(action, Fault):
        return inject(action, topology, job_status(topology.endpoint, job), workdir, rng or random.Random(0))
    action()
    return Injection(action.__name__, "", time.time())


def run_job(
    topology: Topology,
    spec: Path,
    workdir: Path,
    overrides: list[str] = (),
    faults: list[tuple[Action, Moment]] = (),
    rng: random.Random | None = None,
    timeout_s: float = 600,
    expect: tuple[str, ...] = (JobPhase.SUCCEEDED,),
) -> JobRun:
    """Run ``spec`` to its end with ``faults`` (each with its moment); the job must end in ``expect``."""
    job = load_spec(spec).name
    sets = [arg for override in overrides for arg in ("--set", override)]
    erl("submit", str(spec), *sets, "--workdir", str(workdir), "--etcd", topology.endpoint, check=True)
    run = JobRun(workdir, job, {}, started=time.time())
    pending = list(faults)
    deadline = time.monotonic() + timeout_s
    waiting_since = None  # when the due fault first found no target
    while (info := job_status(topology.endpoint, job))["status"]["phase"] in UNFINISHED:
        elapsed = time.time() - run.started
        if pending and _due(pending[0][1], workdir, info["progress"].get("rollouts_done", 0), elapsed):
            action = pending[0][0]
            if rng is not None and waiting_since is None:
                time.sleep(rng.uniform(0, 0.8))
            try:
                run.injections.append(_inject(action, topology, job, workdir, rng))
                pending.pop(0)
                waiting_since = None
            except NoTarget:
                waiting_since = waiting_since or time.monotonic()
                if time.monotonic() - waiting_since > TARGET_WAIT_S:
                    raise
        assert time.monotonic() < deadline, f"job {job} did not finish within {timeout_s:.0f}s: {info['status']}"
        time.sleep(0.2)
    run.status, run.ended = info["status"], time.time()
    assert run.status["phase"] in expect, info
    return run
