"""`erl chaos run SCENARIO.yaml`: a scenario's fault-free reference run, its run with faults, the checks.

    erl chaos run chaos/scenarios/engine-hang.yaml --out runs/chaos/engine-hang

The reference run is reused from the cache when one exists for the same
resolved job spec, topology and code (a hash of the project's Python
sources), else made on a fresh topology. The run with faults gets its own
fresh topology, the faults on schedule, then every invariant
(``chaos.invariants``) and the report (``chaos.report``). The scenario passes
only if every invariant held and every fault found its target.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
from pathlib import Path

import orjson

from chaos.faults import NoTarget
from chaos.invariants import check_run
from chaos.report import ScenarioResult, analyse_faults, write_report
from chaos.runner import JobRun, Moment, generating, run_job, streamed, training
from chaos.scenario import At, ChaosScenario, During, FaultKind
from chaos.topology import REPO, Topology
from checkpoints import layout
from elastic_rl.spec.loading import load_spec
from elastic_rl.store.job_phase import TERMINAL_PHASES, JobPhase
from elastic_rl.trainer.nan_injection import ENV_VAR as NAN_ENV_VAR

# The harness reads the whole rollout log and every snapshot afterwards.
KEEP_EVERYTHING = ["checkpoints.keep_last=1000"]
SOURCES = ("elastic_rl", "daemon", "policies", "checkpoints")
CACHE_ENV = "ERL_CHAOS_CACHE"


def code_hash() -> str:
    digest = hashlib.sha256()
    for package in SOURCES:
        for path in sorted((REPO / package).rglob("*.py")):
            digest.update(str(path.relative_to(REPO)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def reference_key(scenario: ChaosScenario) -> str:
    spec = load_spec(scenario.job, scenario.overrides + KEEP_EVERYTHING).model_dump(mode="json")
    spec.pop("workdir", None)
    identity = {"spec": spec, "topology": scenario.topology.model_dump(mode="json"), "code": code_hash()}
    return hashlib.sha256(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def moment_of(at: At, rng: random.Random) -> Moment:
    if at.during is During.GENERATION:
        return generating(at.rollout) if at.tokens is None else streamed(at.rollout, at.tokens)
    if at.during is During.TRAINING:
        return training(at.rollout)
    if at.rollout is not None:
        return at.rollout
    if at.seconds is not None:
        return float(at.seconds)
    return rng.randint(*at.between)


def make_topology(scenario: ChaosScenario, root: Path, environment: dict[str, str]) -> Topology:
    shape = scenario.topology
    if shape.nodes == 1 and shape.etcd_members == 1:
        return Topology.single(root, shape.cpu_devices, environment, pool=shape.pool)
    return Topology.cluster(
        root,
        shape.nodes,
        shape.cpu_devices,
        shape.etcd_members,
        shape.lease_ttl_s,
        environment,
        pool=shape.pool,
        drain_on_term_s=shape.drain_on_term_s,
        partitionable=scenario.partitionable,
    )


def _run(scenario: ChaosScenario, root: Path, faulty: bool) -> tuple[JobRun, Path]:
    """One run of the scenario's job on a fresh topology; the faults only if ``faulty``."""
    environment = {}
    if faulty and scenario.nan_injection is not None:
        environment[NAN_ENV_VAR] = orjson.dumps(scenario.nan_injection).decode()
    workdir = root / "job"
    # Only the faulty run fills a disk; the reference's work dir is an ordinary folder.
    tmpfs_mb = scenario.topology.workdir_tmpfs_mb if faulty else None
    mounted = _mount_tmpfs(workdir, tmpfs_mb) if tmpfs_mb else False
    rng = random.Random(scenario.seed)
    faults = [(f, moment_of(f.at, rng)) for f in scenario.faults if f.kind is not FaultKind.NAN] if faulty else []
    try:
        with make_topology(scenario, root / "machines", environment) as topology:
            run = run_job(
                topology,
                scenario.job,
                workdir,
                scenario.overrides + KEEP_EVERYTHING,
                faults,
                rng=rng if faulty else None,
                timeout_s=scenario.timeout_s,
                expect=TERMINAL_PHASES,
            )
    finally:
        if mounted:
            # What the run wrote outlives the tmpfs: the checks and the report read it afterwards.
            kept = root / "job-from-tmpfs"
            shutil.copytree(workdir, kept, symlinks=True)
            subprocess.run(["umount", "-l", str(workdir)], check=False)
            shutil.rmtree(workdir, ignore_errors=True)
            kept.rename(workdir)
    return run, workdir


def _mount_tmpfs(folder: Path, size_mb: int) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        raise NoTarget(f"cannot mount a tmpfs for the work dir ({mounted.stderr.strip()}); fill_disk needs root")
    return True


def reference_run(scenario: ChaosScenario, cache: Path) -> tuple[Path, float]:
    """The fault-free run's work dir and wall time, from the cache or made now."""
    folder = cache / reference_key(scenario)
    record = folder / "run.json"
    if record.is_file():
        saved = orjson.loads(record.read_bytes())
        return folder / "job", saved["wall_s"]
    shutil.rmtree(folder, ignore_errors=True)
    run, workdir = _run(scenario, folder, faulty=False)
    if run.status["phase"] != JobPhase.SUCCEEDED:
        raise RuntimeError(f"the fault-free reference run did not succeed: {run.status}")
    wall = wall_time(workdir)
    record.write_bytes(orjson.dumps({"wall_s": wall, "scenario": scenario.name}))
    return workdir, wall


def wall_time(workdir: Path) -> float:
    """From the job's start to its end, by its own events."""
    events = [orjson.loads(line) for line in layout.events_path(workdir).read_text().splitlines()]
    started = min(e["time"] for e in events if e["kind"] == "job_started")
    ended = max(e["time"] for e in events if e["kind"] in ("job_succeeded", "job_failed", "job_stopped"))
    return ended - started


def run_scenario(scenario: ChaosScenario, out: Path, cache: Path | None = None) -> ScenarioResult:
    cache = cache or Path(os.environ.get(CACHE_ENV, REPO / "runs" / ".chaos-cache"))
    out.mkdir(parents=True, exist_ok=True)
    reference, reference_wall = reference_run(scenario, cache)
    shutil.rmtree(out / "faulty", ignore_errors=True)  # a run before into the same --out
    try:
        run, workdir = _run(scenario, out / "faulty", faulty=True)
    except NoTarget as exc:
        result = ScenarioResult(scenario, [], [], reference_wall, 0.0, out, error=f"a fault found no target: {exc}")
        write_report(result, None, reference)
        return result
    checks = check_run(workdir, reference, run.status, scenario.weights_tolerance, scenario.nothing_redone)
    scheduled = sum(fault.kind is not FaultKind.NAN for fault in scenario.faults)
    # A fault whose moment went by unseen (the job ended first) tested nothing.
    missed = [] if len(run.injections) == scheduled else [f"{scheduled - len(run.injections)} fault(s) never fired"]
    seen = {event["kind"] for event in layout.read_lines(layout.events_path(workdir))}
    missed += [f"no {kind.value} event" for kind in scenario.expect_events if kind.value not in seen]
    result = ScenarioResult(
        scenario,
        checks,
        analyse_faults(run, workdir, reference),
        reference_wall,
        wall_time(workdir),
        out,
        "; ".join(missed),
    )
    write_report(result, workdir, reference)
    return result
