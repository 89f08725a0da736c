"""`erl plot JOB`: a PNG of a run, its metrics against rollouts with the job's events marked.

    erl plot tiny-grpo                 # writes <workdir>/plot.png
    erl plot tiny-grpo -o run.png

Reward (with its spread within the rollout), entropy and response length, one
panel each, from ``metrics.jsonl``; every event a user asks about after a
fault (a restart, an engine replaced, a spare promoted, a rollback, a
quarantine) is a vertical line where it happened, placed between rollouts by
its time. Reads only the work dir.
"""

from __future__ import annotations

from pathlib import Path

from checkpoints import layout

PANELS = (
    ("rollout/reward_mean", "reward"),
    ("train/entropy", "entropy"),
    ("rollout/response_length_mean", "response length"),
)
MARKED_EVENTS = {
    "proc_restarted": ("process restarted", "tab:orange"),
    "engine_unhealthy": ("engine replaced", "tab:red"),
    "spare_promoted": ("warm spare promoted", "tab:green"),
    "trainer_rollback": ("rolled back to a snapshot", "tab:purple"),
    "rollout_quarantined": ("rollout quarantined", "tab:brown"),
    "device_quarantined": ("device quarantined", "tab:pink"),
    "job_adopted": ("erld restarted", "tab:gray"),
}


def plot_run(workdir: Path, out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lines = layout.read_lines(layout.metrics_lines_path(workdir))
    if not lines:
        raise ValueError(f"{workdir / 'metrics.jsonl'} holds no rollout yet")
    rollouts = np.array([line["rollout"] for line in lines])
    times = np.array([line["time"] for line in lines])
    events = [e for e in layout.read_lines(layout.events_path(workdir)) if e["kind"] in MARKED_EVENTS]
    figure, axes = plt.subplots(len(PANELS), 1, sharex=True, figsize=(8, 2.4 * len(PANELS)))
    for axis, (key, label) in zip(axes, PANELS):
        values = np.array([line.get(key, np.nan) for line in lines])
        axis.plot(rollouts, values, marker=".", color="tab:blue")
        if key == "rollout/reward_mean":
            spread = np.array([line.get("rollout/reward_std", 0.0) for line in lines])
            axis.fill_between(rollouts, values - spread, values + spread, color="tab:blue", alpha=0.15)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        for event in events:
            name, colour = MARKED_EVENTS[event["kind"]]
            axis.axvline(np.interp(event["time"], times, rollouts), color=colour, linestyle="--", alpha=0.8, label=name)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        axes[0].legend(unique.values(), unique.keys(), fontsize="small", loc="best")
    axes[-1].set_xlabel("rollout")
    figure.suptitle(title)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
