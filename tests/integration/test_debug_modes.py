"""Debug modes: a rollout-only job generates and commits without a trainer; a train-only job trains on
that rollout log without an engine, each of its rollouts once, in order, in whole global batches."""

from __future__ import annotations

import pytest

from chaos.invariants import check_rollouts_applied_once, check_whole_batches, read_spec
from checkpoints import layout
from checkpoints.rollout_log import read_rollout
from tests.integration.erld_support import erl, job_events, metrics, run_job

pytestmark = [pytest.mark.integration]

ROLLOUTS = 3
SHORT = [
    "--set",
    f"rollout.num_rollouts={ROLLOUTS}",
    "--set",
    "rollout.prompts_per_rollout=16",
    "--set",
    "trainer.global_batch_size=128",
]


def started(workdir) -> set[str]:
    return {e["proc"] for e in job_events(workdir) if e["kind"] == "proc_started"}


@pytest.mark.timeout(300)
def test_rollout_only_then_train_only_on_its_log(daemon, tmp_path):
    generated, trained = tmp_path / "rollouts", tmp_path / "trained"
    run_job(daemon, generated, [*SHORT, "--set", "debug.rollout_only=true"])
    assert not any(name.startswith(("trainer-", "spare-")) for name in started(generated))
    lines = metrics(generated)
    assert [line["rollout"] for line in lines] == list(range(ROLLOUTS))
    assert not any(key.startswith("train/") for line in lines for key in line)
    for rollout_id in range(ROLLOUTS):  # nothing trained: the engines kept the initial weights
        assert set(read_rollout(generated, rollout_id)[0].weight_versions.tolist()) == {0}

    # Fewer rollouts in the log than the job trains: named before the job starts.
    short = erl(
        "submit",
        "examples/tiny-grpo.yaml",
        *SHORT[:-4],
        "--set",
        "rollout.num_rollouts=5",
        "--set",
        f"debug.train_only={generated}",
        "--workdir",
        str(tmp_path / "x"),
        "--etcd",
        daemon.endpoint,
    )
    assert short.returncode == 2 and "holds 3 committed rollouts, and the job trains 5" in short.stderr
    smaller = erl(
        "submit",
        "examples/tiny-grpo.yaml",
        *SHORT,
        "--set",
        "rollout.prompts_per_rollout=8",
        "--set",
        f"debug.train_only={generated}",
        "--workdir",
        str(tmp_path / "y"),
        "--etcd",
        daemon.endpoint,
    )
    assert smaller.returncode == 2 and "rollouts hold 256 samples, and the job trains 128" in smaller.stderr

    run_job(daemon, trained, [*SHORT, "--set", f"debug.train_only={generated}"])
    assert not any(name.startswith("engine-") for name in started(trained))
    assert all("train/grad_norm" in line for line in metrics(trained))
    # Each rollout of the source log trained once, in order, every step on a whole global batch of it
    # (the trainers' own metrics): a replay that skipped, repeated or cut a rollout fails here.
    spec = read_spec(trained)
    for check in (check_rollouts_applied_once(trained, spec), check_whole_batches(trained, spec)):
        assert check.held, check
    assert layout.weights_dir(trained, ROLLOUTS).is_dir()
