"""The invariants of DESIGN section 6, checked from a run's work dir and events alone.

``check_run`` compares a run with faults to the fault-free reference run of
the same spec and returns one ``Check`` per invariant:

1. every prompt drawn once: the same (epoch, index) pairs as the reference, in
   order, none twice, those skipped as over-long recorded, and each generated
   group trained once, dropped with a reason, or still in the buffer;
2. every committed rollout applied once: the rollout log holds each rollout
   once, and metrics.jsonl trains each once;
3. every committed step used its whole global batch;
4. every snapshot on disk valid or ignored: no resume started from an invalid one;
5. the final weights equal the reference's, bitwise or within the stated tolerance;
6. no sample generated with weights staler than the spec allows (none in sync
   mode without a buffer, else rollout.max_staleness);
7. the job ended, and a job that did not succeed says why;
8. no token generated twice: no token the orchestrator received came a second
   time (``rollout/regenerated_tokens``), and where an orchestrator died, its
   successor regenerated at most about a persist interval's tokens for each
   death: what the engines generated in all (their own counts, kept by erld:
   ``engines.token_ledger``) less the reference's, where both runs draw the
   same tokens (deterministic, no partial rollout).
9. where the faults leave time to hand work over (a drain that met its deadline)
   or cost no restart at all (an etcd outage), nothing redone: no replica resumed
   from a snapshot behind the published weights (its replay would train rollouts
   again), no process crashed or was restarted, and no group was taken at a deadline.
10. every token from a weight version its rollout allows: each segment of each
   sample (the tokens one request made) from the version the rollout was
   generated with, or one within the staleness bound behind the rollout; the
   batch records each sample's first segment's version; the orchestrator saw no
   mismatch either (``policies.determinism``).
11. where deterministic mode promises it (cpu engines, an fp32 trainer), the
   trainer's log probs of every rollout's samples of the weights it held are
   the engines' within ``JobSpec.logprob_gap_bound``, and the orchestrator reported no
   rollout past it.
12. one writer: no superseded instance of a process committed after its
   successor. Each rollout records the orchestrator that wrote it and each
   snapshot the trainer rank, with their assignment generations: in commit
   order, one process's generation never goes back. A process cut off from
   etcd (a partition) whose work moved would show as an older generation
   after a newer one.

The run must keep its whole rollout log and every snapshot (the harness sets
``checkpoints.keep_last`` high).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson
import torch
from safetensors.torch import load_file

from checkpoints import layout
from checkpoints.discovery import valid_steps
from checkpoints.manifest import read_manifest
from checkpoints.rollout_log import BATCH_FILE
from elastic_rl.engines import token_ledger
from elastic_rl.spec.job import JobSpec
from elastic_rl.store.job_phase import JobPhase
from policies.determinism import ON_POLICY_GAP, logprob_gap_exceeded, versions_out_of_bounds


@dataclass(frozen=True)
class Check:
    name: str
    held: bool
    detail: str

    def to_json(self) -> dict:
        return {"name": self.name, "held": self.held, "detail": self.detail}


def read_spec(workdir: Path) -> JobSpec:
    return JobSpec.model_validate(orjson.loads(layout.spec_path(workdir).read_bytes()))


def _rollout(workdir: Path, rollout_id: int) -> tuple[dict[str, torch.Tensor], dict]:
    folder = layout.rollout_dir(workdir, rollout_id)
    return load_file(str(folder / BATCH_FILE)), orjson.loads((folder / layout.META_FILE).read_bytes())


def _trained_groups(batch: dict[str, torch.Tensor], spec: JobSpec) -> list[tuple[int, int]]:
    pairs = list(zip(batch["prompt_epochs"].tolist(), batch["prompt_indices"].tolist()))
    return pairs[:: spec.rollout.n_samples_per_prompt]


def drawn_prompts(workdir: Path, spec: JobSpec) -> list[tuple[int, int]]:
    """(epoch, index) of every prompt drawn, in order: the skipped ones, then those generated."""
    drawn = []
    for rollout_id in layout.committed_rollouts(workdir):
        batch, meta = _rollout(workdir, rollout_id)
        drawn += [(epoch, index) for index, epoch in meta.get("skipped_prompts", [])]
        drawn += [(epoch, index) for index, epoch in meta["drawn_prompts"]]
    return drawn


def unaccounted_groups(workdir: Path, spec: JobSpec) -> list[tuple[int, int]]:
    """Generated groups (epoch, index) not trained, dropped or buffered exactly once; [] when all are."""
    generated: list[tuple[int, int]] = []
    accounted: list[tuple[int, int]] = []
    buffered: list[tuple[int, int]] = []
    for rollout_id in layout.committed_rollouts(workdir):
        batch, meta = _rollout(workdir, rollout_id)
        generated += [(epoch, index) for index, epoch in meta["drawn_prompts"]]
        accounted += _trained_groups(batch, spec)
        accounted += [(epoch, index) for index, epoch, _ in meta["dropped_groups"]]
        buffered = [(group["prompt"]["epoch"], group["prompt"]["index"]) for group in meta["buffer"]]
    accounted += buffered
    return sorted(set(generated) ^ set(accounted)) + sorted({g for g in accounted if accounted.count(g) > 1})


def check_prompts(run: Path, reference: Path, spec: JobSpec) -> Check:
    mine, theirs = drawn_prompts(run, spec), drawn_prompts(reference, spec)
    repeated = len(mine) - len(set(mine))
    if repeated:
        return Check("every prompt drawn once", False, f"{repeated} prompts drawn twice")
    if lost := unaccounted_groups(run, spec):
        return Check("every prompt drawn once", False, f"groups not trained, dropped or buffered once: {lost[:5]}")
    if mine != theirs:
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        return Check("every prompt drawn once", False, f"the draws differ from the reference's from draw {first}")
    return Check("every prompt drawn once", True, f"{len(mine)} prompts, the reference's, in its order")


def check_rollouts_applied_once(run: Path, spec: JobSpec) -> Check:
    expected = list(range(spec.rollout.num_rollouts))
    committed = layout.committed_rollouts(run)
    # Retention cuts the log below the oldest kept snapshot's last rollout: what it cut is in that snapshot.
    first = committed[0] if committed else len(expected)
    kept_from = min((_snapshot_last_rollout(run, step) for step in valid_steps(run)), default=None)
    if committed != expected[first:] or (first > 0 and (kept_from is None or kept_from < first - 1)):
        return Check("every committed rollout applied once", False, f"rollout log holds {committed}")
    trained = [line["rollout"] for line in layout.read_lines(layout.metrics_lines_path(run))]
    if trained != expected:
        return Check("every committed rollout applied once", False, f"metrics.jsonl trains {trained}")
    return Check(
        "every committed rollout applied once", True, f"{len(expected)} rollouts, each committed and trained once"
    )


def check_one_writer(run: Path) -> Check:
    """Per process, the assignment generations of what it committed, in commit order, never go back."""
    written: dict[str, list[int]] = {}
    for rollout in layout.committed_rollouts(run):
        writer = _rollout(run, rollout)[1].get("writer", {})
        if writer.get("generation") is not None:
            written.setdefault("orchestrator", []).append(writer["generation"])
    for step in sorted(valid_steps(run)):
        writer = read_manifest(layout.snapshot_path(run, step)).get("writer")
        if writer is not None:
            written.setdefault(writer["proc"], []).append(writer["generation"])
    back = {proc: generations for proc, generations in written.items() if generations != sorted(generations)}
    if back:
        return Check("one writer", False, f"a superseded instance committed after its successor: {back}")
    counted = sum(len(generations) for generations in written.values())
    return Check("one writer", True, f"{counted} rollouts and snapshots, no superseded writer among them")


def _snapshot_last_rollout(run: Path, step: int) -> int:
    return int(read_manifest(layout.snapshot_path(run, step))["last_rollout"])


def check_whole_batches(run: Path, spec: JobSpec) -> Check:
    short = []
    for line in layout.read_lines(layout.metrics_lines_path(run)):
        if line.get("train/quarantined"):
            continue
        if line.get("train/samples_per_step") != spec.trainer.global_batch_size:
            short.append((line["rollout"], line.get("train/samples_per_step")))
    if short:
        return Check("every committed step used its whole global batch", False, f"(rollout, samples a step): {short}")
    return Check(
        "every committed step used its whole global batch",
        True,
        f"{spec.trainer.global_batch_size} samples in every step",
    )


def check_snapshots(run: Path, events: list[dict]) -> Check:
    valid = set(valid_steps(run))
    resumed = [e["step"] for e in events if e["kind"] == "trainer_resumed"]
    bad = [step for step in resumed if step not in valid]
    if bad:
        return Check("every snapshot valid or ignored", False, f"resumed from invalid snapshots {bad}")
    skipped = sum(1 for e in events if e["kind"] == "snapshot_skipped")
    return Check(
        "every snapshot valid or ignored", True, f"{len(resumed)} resumes, all from valid snapshots; {skipped} skipped"
    )


def check_weights(run: Path, reference: Path, spec: JobSpec, tolerance: float | None) -> Check:
    if tolerance is None:
        quarantined = sorted(layout.quarantined_rollouts(run))
        return Check(
            "final weights equal the reference's", True, f"not compared by design; quarantined rollouts {quarantined}"
        )
    version = spec.rollout.num_rollouts
    mine = load_file(str(layout.weights_dir(run, version) / "model.safetensors"))
    theirs = load_file(str(layout.weights_dir(reference, version) / "model.safetensors"))
    if mine.keys() != theirs.keys():
        return Check("final weights equal the reference's", False, "the tensors differ by name")
    worst = 0.0
    for name in theirs:
        scale = theirs[name].abs().max().clamp_min(1e-12)
        worst = max(worst, ((mine[name] - theirs[name]).abs().max() / scale).item())
    if tolerance == 0:
        return Check(
            "final weights equal the reference's",
            worst == 0,
            "bitwise equal" if worst == 0 else f"relative error {worst:.2e}",
        )
    return Check(
        "final weights equal the reference's",
        worst <= tolerance,
        f"relative error {worst:.2e} (tolerance {tolerance:g})",
    )


def check_staleness(run: Path, spec: JobSpec) -> Check:
    bound = spec.rollout.staleness_bound
    stale = []
    for rollout_id in layout.committed_rollouts(run):
        versions = _rollout(run, rollout_id)[0]["weight_versions"]
        lag = rollout_id - int(versions.min())
        if lag > bound:
            stale.append((rollout_id, lag))
    if stale:
        return Check("no sample staler than the bound", False, f"(rollout, versions behind): {stale}")
    return Check("no sample staler than the bound", True, f"every sample at most {bound} version(s) behind")


def check_segment_versions(run: Path, spec: JobSpec, events: list[dict]) -> Check:
    name = "every token from a weight version its rollout allows"
    wrong = []
    for rollout_id in layout.committed_rollouts(run):
        batch, meta = _rollout(run, rollout_id)
        versions = [[segment["version"] for segment in sample["segments"]] for sample in meta["samples"]]
        served = int(meta["metrics"]["rollout/weight_version"])
        bad = versions_out_of_bounds(versions, served, spec.rollout.oldest_allowed(rollout_id, served))
        recorded = batch["weight_versions"].tolist()
        bad += [i for i, segments in enumerate(versions) if segments and recorded[i] != segments[0]]
        wrong += [(rollout_id, index, versions[index]) for index in sorted(set(bad))]
    reported = [e["rollout"] for e in events if e["kind"] == "weight_version_mismatch"]
    if wrong or reported:
        return Check(name, False, f"(rollout, sample, segment versions): {wrong[:5]}; reported in rollouts {reported}")
    return Check(name, True, "every segment of every sample from an allowed version, as its batch records")


def check_logprob_gap(run: Path, spec: JobSpec, events: list[dict]) -> Check:
    name = "the trainer's log probs are the engines'"
    bound = spec.logprob_gap_bound
    if bound is None:
        return Check(name, True, "not promised (deterministic mode with cpu engines and an fp32 trainer only)")
    lines = layout.read_lines(layout.metrics_lines_path(run))
    gaps = [(line["rollout"], line.get(ON_POLICY_GAP)) for line in lines]
    past = [(rollout_id, gap) for rollout_id, gap in gaps if logprob_gap_exceeded(gap, bound)]
    reported = [e["rollout"] for e in events if e["kind"] == "logprob_gap_exceeded"]
    if past or reported:
        return Check(name, False, f"(rollout, gap) past {bound:g}: {past[:5]}; reported in {reported}")
    largest = max((gap for _, gap in gaps if gap is not None), default=0.0)
    return Check(name, True, f"largest gap {largest:.2e} (bound {bound:g})")


ORCHESTRATOR_DEATH_SLACK = 2.0
"""A dead orchestrator's successor regenerates what arrived after the last persist, plus what the engines
made before they saw its requests go: up to about twice a persist interval's worth."""


def check_tokens_once(run: Path, reference: Path, spec: JobSpec, events: list[dict]) -> Check:
    name = "no token generated twice"
    lines = layout.read_lines(layout.metrics_lines_path(run))
    twice = sum(int(line.get("rollout/regenerated_tokens", 0)) for line in lines)
    if twice:
        return Check(name, False, f"{twice} tokens received for a position that had arrived before")
    starts = [e for e in events if e.get("proc") == "orchestrator" and e["kind"] in ("proc_restarted", "proc_started")]
    comparable = spec.rollout.deterministic and not spec.rollout.partial_rollout
    if not starts or not comparable or not layout.engine_tokens_files(reference):
        return Check(name, True, "no token received twice")
    extra = token_ledger.total(run) - token_ledger.total(reference)
    if spec.rollout.rollout_function:
        # Continuation lives in the engine client: a restarted orchestrator calls the function again, whole, so
        # each restart may generate one rollout's tokens again.
        restarts = sum(e["kind"] == "proc_restarted" for e in starts)
        allowed = restarts * max(line.get("rollout/generated_tokens", 0.0) for line in lines)
    else:
        rate = max(line.get("perf/generated_tokens_per_sec", 0.0) for line in lines)
        allowed = len(starts) * spec.rollout.inflight_persist_interval_s * rate * ORCHESTRATOR_DEATH_SLACK
    detail = (
        f"no token received twice; across {len(starts)} orchestrator restart(s) the engines generated {extra} "
        f"tokens more than the reference (at most {allowed:.0f})"
    )
    return Check(name, extra <= allowed, detail)


REDONE = ("proc_exited", "proc_restarted", "drain_overdue")
"""Events that a drain meeting its deadline, or an etcd outage, never causes: each means some work was lost or
done again."""


def check_nothing_redone(events: list[dict]) -> Check:
    redone = [
        f"{e['kind']} ({e.get('proc') or e.get('group') or '-'})"
        for e in events
        if e["kind"] in REDONE or (e["kind"] == "trainer_resumed" and e.get("redone_rollouts", 1))
    ]
    if redone:
        return Check("nothing redone", False, ", ".join(redone))
    left = sum(1 for e in events if e["kind"] in ("replica_left", "orchestrator_left", "engine_draining"))
    return Check("nothing redone", True, f"{left} process(es) left at a safe point; no step trained twice, no crash")


def check_terminal(status: dict) -> Check:
    phase, reason = status.get("phase"), status.get("reason", "")
    if phase == JobPhase.SUCCEEDED:
        return Check("the job ended with a reason", True, "succeeded")
    if phase in (JobPhase.FAILED, JobPhase.STOPPED) and reason:
        return Check("the job ended with a reason", False, f"{phase}: {reason}")
    return Check("the job ended with a reason", False, f"{phase} without a reason")


def check_run(
    run: Path, reference: Path, status: dict, tolerance: float | None, nothing_redone: bool = False
) -> list[Check]:
    """Every invariant; ``nothing_redone``: the faults leave time to hand work over, or cost no restart (9)."""
    spec = read_spec(run)
    events = layout.read_lines(layout.events_path(run))
    checks = [check_terminal(status)]
    if status.get("phase") != JobPhase.SUCCEEDED:
        return checks
    if nothing_redone:
        checks.append(check_nothing_redone(events))
    return checks + [
        check_prompts(run, reference, spec),
        check_rollouts_applied_once(run, spec),
        check_whole_batches(run, spec),
        check_snapshots(run, events),
        check_weights(run, reference, spec, tolerance),
        check_staleness(run, spec),
        check_tokens_once(run, reference, spec, events),
        check_segment_versions(run, spec, events),
        check_logprob_gap(run, spec, events),
        check_one_writer(run),
    ]
