"""Partial rollout through real engines: requests still out when a rollout is full are aborted, their
tokens wait in the committed buffer and the next rollout generates them on. With the orchestrator
killed while the buffer holds aborted groups and a trainer killed later, nothing is lost or trained
twice, and the weights are bitwise those of a fault-free run trained on the same rollout log."""

from __future__ import annotations

import pytest

from chaos.invariants import (
    check_rollouts_applied_once,
    check_staleness,
    check_weights,
    check_whole_batches,
    drawn_prompts,
    read_spec,
    unaccounted_groups,
)
from checkpoints import layout
from checkpoints.rollout_log import read_rollout
from tests.integration.erld_support import metrics, run_job

pytestmark = [pytest.mark.integration]

ROLLOUTS = 8
SAMPLES = 4
JOB = [
    "--set",
    f"rollout.num_rollouts={ROLLOUTS}",
    "--set",
    "rollout.prompts_per_rollout=8",
    "--set",
    "rollout.over_sampling_batch_size=16",
    "--set",
    f"rollout.n_samples_per_prompt={SAMPLES}",
    "--set",
    "rollout.max_new_tokens=8",
    "--set",
    "rollout.partial_rollout=true",
    "--set",
    "rollout.max_concurrency=16",  # requests queue: when 8 groups are done others are mid-way
    "--set",
    "trainer.global_batch_size=32",
    "--set",
    "trainer.micro_batch_size=32",
    "--set",
    "checkpoints.keep_last=1000",
]


def aborted_groups_buffered(workdir) -> bool:
    """A rollout is committed whose buffer holds groups a partial rollout aborted."""
    for rollout_id in layout.committed_rollouts(workdir):
        buffer = read_rollout(workdir, rollout_id)[1]["buffer"]
        if any(sample["status"] == "unfinished" for group in buffer for sample in group["samples"]):
            return True
    return False


@pytest.mark.timeout(400)
def test_partial_rollout_loses_and_repeats_nothing_through_kills(daemon, tmp_path):
    faulty, replayed = tmp_path / "faulty", tmp_path / "replayed"
    killed = run_job(daemon, faulty, JOB, [("orchestrator", aborted_groups_buffered), ("trainer-0-0", 4)])
    assert killed == ["orchestrator", "trainer-0-0"]
    spec = read_spec(faulty)

    lines = metrics(faulty)
    assert sum(line["rollout/aborted_samples"] for line in lines) > 0
    assert sum(line["rollout/continued_groups"] for line in lines) > 0
    # Every drawn prompt once; each group trained (all its samples), dropped with a reason, or still buffered.
    drawn = drawn_prompts(faulty, spec)
    assert len(drawn) == len(set(drawn))
    assert unaccounted_groups(faulty, spec) == []
    continued = 0
    for rollout_id in range(ROLLOUTS):
        batch, meta = read_rollout(faulty, rollout_id)
        groups = list(zip(batch.prompt_epochs.tolist(), batch.prompt_indices.tolist()))
        assert all(groups.count(group) == SAMPLES for group in groups)  # every (prompt, sample index) once
        assert len(meta["samples"]) == batch.size
        for row, sample in enumerate(meta["samples"]):
            segments = sample["segments"]
            assert sum(segment["tokens"] for segment in segments) == int(batch.response_lengths[row])
            assert segments[0]["version"] == int(batch.weight_versions[row])
            continued += len({segment["version"] for segment in segments}) > 1
    assert continued > 0  # samples begun by one rollout's weights and generated on by the next's were trained
    for check in (
        check_rollouts_applied_once(faulty, spec),
        check_whole_batches(faulty, spec),
        check_staleness(faulty, spec),
    ):
        assert check.held, check

    # Which requests an abort catches is timing: the reference trains, fault-free, on the same log.
    run_job(daemon, replayed, [*JOB, "--set", f"debug.train_only={faulty}"])
    check = check_weights(replayed, faulty, spec, tolerance=0.0)
    assert check.held, check
