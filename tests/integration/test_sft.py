"""SFT through the same job machinery: the loss falls on the copy task, and a trainer kill changes nothing."""

from __future__ import annotations

from statistics import mean

import pytest
import yaml

from chaos.invariants import check_run
from checkpoints import layout
from tests.integration.erld_support import job_events, metrics, run_job, status
from tests.processes import SPEC

pytestmark = [pytest.mark.integration]

ROLLOUTS = 24
# The tiny example's copy task as (prompt, response) pairs: "7=" then "7" and end-of-sequence.
SFT_JOB = [
    "--set",
    "algorithm.kind=sft",
    "--set",
    f"rollout.num_rollouts={ROLLOUTS}",
    "--set",
    "rollout.n_samples_per_prompt=1",
    "--set",
    "rollout.max_new_tokens=2",
    "--set",
    "rollout.prompts_per_rollout=64",
    "--set",
    "trainer.global_batch_size=16",
    "--set",
    "trainer.micro_batch_size=16",
    "--set",
    "checkpoints.keep_last=1000",
    "--set",
    "checkpoints.interval_rollouts=2",
    "--set",
    "engines.count=1",  # SFT generates nothing; the engine only loads each version
]


@pytest.mark.timeout(600)
def test_sft_learns_the_copy_task_survives_a_trainer_kill_and_warm_starts_grpo(daemon, tmp_path):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(daemon, clean, SFT_JOB)
    losses = [line["train/loss"] for line in metrics(clean)]
    assert len(losses) == ROLLOUTS and mean(losses[-3:]) < 0.5 * mean(losses[:3]), losses
    # Nothing RL-only is reported for SFT.
    assert not any(key in metrics(clean)[0] for key in ("train/ppo_kl", "train/clipfrac", "rollout/reward_mean"))

    assert run_job(daemon, faulty, SFT_JOB, [("trainer-0-0", 3)]) == ["trainer-0-0"]
    checks = check_run(faulty, clean, status(daemon, "tiny-grpo")["status"], tolerance=0.0)
    assert all(check.held for check in checks), [check for check in checks if not check.held]
    assert any(e["kind"] == "trainer_resumed" for e in job_events(faulty))

    # A warm start: GRPO from the SFT job's last weights, exported as an HF checkpoint, copies at once
    # (a random model scores about 0.02 on the task).
    grpo = yaml.safe_load(SPEC.read_text()) | {"model": {"hf_checkpoint": str(layout.weights_dir(clean, ROLLOUTS))}}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(grpo))
    run_job(daemon, tmp_path / "grpo", ["--set", "rollout.num_rollouts=1"], spec=tmp_path / "grpo.yaml")
    assert metrics(tmp_path / "grpo")[0]["rollout/reward_mean"] >= 0.9
