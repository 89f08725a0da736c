"""Checkpoint-first: SIGKILL job processes mid-run; the run ends exactly as a fault-free one."""

from __future__ import annotations

import os
import random
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elastic_rl import jobenv
from tests.integration.erld_support import STOP_AND_RESUME, job_events, metrics, run_job

pytestmark = [pytest.mark.integration]

ROLLOUTS = 16
# Keep every snapshot and rollout so the test can read the whole log afterwards; a dead
# lighthouse costs the trainer one quorum timeout, kept short here.
JOB = [
    "--set", f"rollout.num_rollouts={ROLLOUTS}",
    "--set", "checkpoints.keep_last=1000",
    "--set", "fault_tolerance.quorum_timeout_s=10",
]  # fmt: skip
def drawn_prompts(workdir: Path) -> list[tuple[int, int]]:
    """(epoch, dataset index) of every prompt of every committed rollout, in order."""
    drawn = []
    for rollout_id in jobenv.committed_rollouts(workdir):
        batch = load_file(str(jobenv.rollout_dir(workdir, rollout_id) / "batch.safetensors"))
        pairs = list(zip(batch["prompt_epochs"].tolist(), batch["prompt_indices"].tolist()))
        drawn += pairs[:: 16]  # one entry per GRPO group (n_samples_per_prompt = 16)
    return drawn


@pytest.mark.timeout(900)
def test_killing_any_job_process_changes_nothing(daemon, tmp_path):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(daemon, clean, JOB)
    schedule = [("trainer-0-0", 3), ("router", 5), ("orchestrator", 7), ("lighthouse", 9), ("engine-0", 11),
                (STOP_AND_RESUME, 12), ("trainer-0-0", 14)]  # fmt: skip
    killed = run_job(daemon, faulty, JOB, schedule)
    assert len(killed) == len(schedule), killed

    # Weights equal the fault-free run's bitwise.
    expected = load_file(str(jobenv.weights_dir(clean, ROLLOUTS) / "model.safetensors"))
    actual = load_file(str(jobenv.weights_dir(faulty, ROLLOUTS) / "model.safetensors"))
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name

    # The same prompts were drawn, none twice within an epoch, and every rollout is in the log once.
    assert drawn_prompts(faulty) == drawn_prompts(clean)
    assert max(Counter(drawn_prompts(faulty)).values()) == 1
    assert jobenv.committed_rollouts(faulty) == list(range(ROLLOUTS))
    assert [line["rollout"] for line in metrics(faulty)] == list(range(ROLLOUTS))
    events = job_events(faulty)
    assert [e["kind"] for e in events].count("job_stopped") == 1
    assert any(e["kind"] == "trainer_resumed" and e["proc"] == "trainer-0-0" for e in events)
    commits = Counter(re.findall(r"rollout (\d+) committed", (faulty / "logs" / "orchestrator.log").read_text()))
    assert set(commits.values()) == {1}, commits


CHAOS_TARGETS = ("trainer-0-0", "orchestrator", "router", "lighthouse", "engine-0", "engine-1", "erld")


def chaos_schedule(seed: int, count: int = 6) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    moments = sorted(rng.sample(range(1, ROLLOUTS - 1), count))
    return [(rng.choice(CHAOS_TARGETS), moment) for moment in moments]


@pytest.mark.chaos
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("round_number", range(5))
def test_random_kills_change_nothing(daemon, tmp_path, round_number):
    """`make chaos`: five rounds of kills at random rollouts and moments, erld itself included."""
    seed = int(os.environ.get("ERL_CHAOS_SEED", "0")) * 100 + round_number
    schedule = chaos_schedule(seed)
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(daemon, clean, JOB)
    done = run_job(daemon, faulty, JOB, schedule, jitter=random.Random(seed))
    assert done, schedule
    expected = load_file(str(jobenv.weights_dir(clean, ROLLOUTS) / "model.safetensors"))
    actual = load_file(str(jobenv.weights_dir(faulty, ROLLOUTS) / "model.safetensors"))
    for name in expected:
        assert torch.equal(expected[name], actual[name]), (name, schedule)
    assert drawn_prompts(faulty) == drawn_prompts(clean)
    commits = Counter(re.findall(r"rollout (\d+) committed", (faulty / "logs" / "orchestrator.log").read_text()))
    assert set(commits.values()) == {1}, (commits, schedule)
    assert [line["rollout"] for line in metrics(faulty)] == list(range(ROLLOUTS)), schedule
