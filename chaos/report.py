"""A chaos scenario's report: report.md, report.json and timeline.png in the scenario's --out folder.

What a scenario's run found is a ``ScenarioResult`` (the harness, ``chaos.harness``,
returns one): the invariants' verdicts, a ``FaultReport`` per fault, and the
wall times of the fault-free run and the faulty one; ``write_report`` renders it.
For each fault, from the run's events and metrics against the fault-free run:

- detection: from the fault to the first event that saw it (a process exit,
  an unhealthy engine, a smaller quorum, a skipped NaN step, a group moved);
- back to progress: from the fault to the first rollout trained after that;
- time lost: how much longer the rollouts around the fault took than the
  reference's median rollout;
- steps redone: optimizer steps trained again (a resume from an older
  snapshot replays them; a skipped NaN step is redone);
- samples lost: samples of the reference run never trained (must be 0).

The headline is the ETTR, the reference's wall time over the faulty run's.
The timeline draws reward and rollouts trained against wall time, each fault
a line, each span from fault to progress shaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

import orjson

from chaos.invariants import Check, drawn_prompts, read_spec
from chaos.runner import JobRun
from chaos.scenario import ChaosScenario
from checkpoints import layout
from policies.fault_time import FAULT_SIGNS


@dataclass
class FaultReport:
    kind: str
    target: str
    at_s: float
    """Seconds after the job started."""
    detection_s: float | None
    progress_s: float | None
    time_lost_s: float
    steps_redone: int
    samples_lost: int


@dataclass
class ScenarioResult:
    """What a scenario's run found: every invariant's verdict, each fault's figures, both wall times.
    The report renders it; the harness returns it."""

    scenario: ChaosScenario
    checks: list[Check]
    faults: list[FaultReport]
    reference_wall_s: float
    faulty_wall_s: float
    out: Path
    """The scenario's --out folder, where the report goes."""
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and all(check.held for check in self.checks)

    @property
    def ettr(self) -> float:
        """Effective training time ratio: the fault-free run's wall time over the faulty run's."""
        return self.reference_wall_s / self.faulty_wall_s if self.faulty_wall_s else 0.0


def analyse_faults(run: JobRun, workdir: Path, reference: Path) -> list[FaultReport]:
    events = layout.read_lines(layout.events_path(workdir))
    lines = layout.read_lines(layout.metrics_lines_path(workdir))
    spec = read_spec(workdir)
    steps_per_rollout = spec.rollout.samples_per_rollout // spec.trainer.global_batch_size
    started = min(e["time"] for e in events if e["kind"] == "job_started")
    reference_lines = layout.read_lines(layout.metrics_lines_path(reference))
    gaps = [b["time"] - a["time"] for a, b in zip(reference_lines, reference_lines[1:])]
    usual = median(gaps) if gaps else 0.0
    drawn = set(drawn_prompts(workdir, spec))
    lost = len(set(drawn_prompts(reference, spec)) - drawn) * spec.rollout.n_samples_per_prompt
    reports = []
    for injection in run.injections:
        moment = injection.time
        seen = next((e["time"] for e in events if e["time"] >= moment and e["kind"] in FAULT_SIGNS), None)
        before = [line for line in lines if line["time"] <= moment]
        after = next((line for line in lines if line["time"] > (seen or moment)), None)
        progress = None if after is None else after["time"] - moment
        last = before[-1]["time"] if before else started
        time_lost = max(0.0, (after["time"] - last) - usual) if after is not None else 0.0
        done_at_fault = (before[-1]["rollout"] + 1) * steps_per_rollout if before else 0
        redone = sum(
            max(0, done_at_fault - e["step"]) for e in events if e["kind"] == "trainer_resumed" and e["time"] >= moment
        )
        redone += sum(1 for e in events if e["kind"] == "nan_step_skipped" and e["time"] >= moment)
        reports.append(
            FaultReport(
                injection.kind,
                injection.target,
                round(moment - started, 3),
                None if seen is None else round(seen - moment, 3),
                None if progress is None else round(progress, 3),
                round(time_lost, 3),
                redone,
                lost,
            )
        )
    return reports


def write_report(result: ScenarioResult, workdir: Path | None, reference: Path) -> None:
    out = result.out
    data = {
        "scenario": result.scenario.name,
        "passed": result.passed,
        "error": result.error,
        "ettr": round(result.ettr, 4),
        "reference_wall_s": round(result.reference_wall_s, 3),
        "faulty_wall_s": round(result.faulty_wall_s, 3),
        "invariants": [check.to_json() for check in result.checks],
        "faults": [asdict(fault) for fault in result.faults],
        "workdir": str(workdir) if workdir else None,
        "reference_workdir": str(reference),
    }
    (out / "report.json").write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    if workdir is not None:
        timeline(workdir, result, out / "timeline.png")
    (out / "report.md").write_text(markdown(result))


def markdown(result: ScenarioResult) -> str:
    scenario = result.scenario
    verdict = "PASSED" if result.passed else "FAILED"
    lines = [f"# Chaos scenario `{scenario.name}`: {verdict}", ""]
    if scenario.description:
        lines += [scenario.description, ""]
    if result.error:
        lines += [f"**{result.error}**", ""]
    lines += [
        f"ETTR {result.ettr:.3f}: the fault-free run took {result.reference_wall_s:.1f} s, "
        f"this one {result.faulty_wall_s:.1f} s.",
        "",
        "| invariant | held | detail |",
        "|---|---|---|",
        *(f"| {c.name} | {'yes' if c.held else '**no**'} | {c.detail} |" for c in result.checks),
        "",
        "| fault | target | at (s) | detected after (s) | back to progress after (s) | time lost (s) | steps redone "
        "| samples lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in result.faults:
        show = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
        lines.append(
            f"| {f.kind} | {f.target} | {f.at_s:.1f} | {show(f.detection_s)} | {show(f.progress_s)} | "
            f"{f.time_lost_s:.2f} | {f.steps_redone} | {f.samples_lost} |"
        )
    lines += ["", "![timeline](timeline.png)", ""]
    return "\n".join(lines)


def timeline(workdir: Path, result: ScenarioResult, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = layout.read_lines(layout.events_path(workdir))
    lines = layout.read_lines(layout.metrics_lines_path(workdir))
    started = min(e["time"] for e in events if e["kind"] == "job_started")
    minutes = [(line["time"] - started) / 60 for line in lines]
    figure, (reward, progress) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    reward.plot(minutes, [line["rollout/reward_mean"] for line in lines], marker=".", color="tab:blue")
    reward.set_ylabel("reward")
    progress.step(minutes, [line["rollout"] + 1 for line in lines], where="post", color="tab:green")
    progress.set_ylabel("rollouts trained")
    progress.set_xlabel("minutes since the job started")
    for fault in result.faults:
        at = fault.at_s / 60
        for axis in (reward, progress):
            axis.axvline(at, color="tab:red", linestyle="--")
            if fault.progress_s is not None:
                axis.axvspan(at, at + fault.progress_s / 60, color="tab:red", alpha=0.12)
        progress.annotate(
            f"{fault.kind} {fault.target}",
            (at, 0.03),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize="x-small",
            va="bottom",
            ha="right",
        )
    for axis in (reward, progress):
        axis.grid(alpha=0.3)
    figure.suptitle(f"{result.scenario.name}: ETTR {result.ettr:.3f}")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
