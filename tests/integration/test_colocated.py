"""Colocated mode under a real erld: a trainer rank and an engine share a slot and take turns."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from chaos.invariants import check_rollouts_applied_once, read_spec
from chaos.runner import training
from checkpoints import layout
from tests.integration.erld_support import job_events, metrics, run_job, status
from tests.integration.test_replicas import assert_close_relative, final_weights

pytestmark = [pytest.mark.integration]

COLOCATED = Path(__file__).parents[2] / "examples" / "tiny-grpo-colocated.yaml"
ROLLOUTS = 4


@pytest.mark.timeout(240)
def test_a_colocated_job_trains_the_same_weights_as_a_disaggregated_one(daemon, tmp_path):
    apart, shared = tmp_path / "apart", tmp_path / "shared"
    # PPO: the critic's state takes the turns beside the policy's (on a CPU slot only the protocol runs).
    short = [
        *("--set", f"rollout.num_rollouts={ROLLOUTS}", "--set", "checkpoints.keep_last=1000"),
        *("--set", "algorithm.advantage_estimator=ppo"),
    ]
    run_job(daemon, apart, ["--set", "engines.count=1", *short])

    seen = {}

    def read_status() -> None:
        seen.update(status(daemon, "tiny-grpo-colocated"))

    # Weights passed in memory: the engine loads each version from shared memory, not the disk export. The
    # engine hangs (SIGSTOP) while its memory is released for the trainer's turn on rollout 2: its resume
    # does not end, and the handover's timeout, well before the health check's, has it replaced.
    colocated = [
        *short,
        *("--set", "engines.weight_sync=memory"),
        *("--set", "fault_tolerance.handover_timeout_s=3", "--set", "engines.hang_timeout_s=120"),
    ]
    faults = [(read_status, 1), ("engine-0", training(2))]
    run_job(daemon, shared, colocated, faults=faults, signal_number=signal.SIGSTOP, spec=COLOCATED)

    # One slot holds the trainer rank and the engine; the job's processes take no other slot.
    assert [sorted(held) for held in seen["slots"].values()] == [["engine-0", "trainer-0-0"]], seen["slots"]
    # The same seed, deterministic engines: the turns change nothing of what is trained.
    assert_close_relative(final_weights(apart, ROLLOUTS), final_weights(shared, ROLLOUTS), 1e-6)
    check = check_rollouts_applied_once(shared, read_spec(shared))
    assert check.held, check
    lines = metrics(shared)
    assert [line["rollout"] for line in lines] == list(range(ROLLOUTS))
    slot = f"test-node/{seen['procs']['trainer-0-0']['device']}"
    # Every version loaded came from shared memory: after the first (the initial weights, which the engine
    # starts on), and but for the one after the hang, which the replacement may have started on.
    from_memory = [line.get("rollout/weights_from_memory") for line in lines]
    assert from_memory[:3] == [None, 1.0, 1.0] and from_memory[3] in (None, 1.0), from_memory
    hung = [e for e in job_events(shared) if e["kind"] in ("handover_timeout", "engine_unhealthy")]
    assert [e["kind"] for e in hung] == ["handover_timeout", "engine_unhealthy"], hung
    assert "did not resume its memory" in hung[1]["message"] and hung[1]["proc"] == "engine-0"
    deadline = time.monotonic() + 30
    while layout.memory_weights_root(shared).exists():  # erld drops the copies once the job is over
        assert time.monotonic() < deadline, list(layout.memory_weights_root(shared).iterdir())
        time.sleep(0.2)
    for line in lines:
        # Every turn happened and was timed, and the slot's peak memory of each phase is reported.
        assert line["handover/release_time"] >= 0 and line["train/offload_time"] >= 0, line
        assert line[f"memory/{slot}/generation_peak_bytes"] > 0, line
        assert line[f"memory/{slot}/training_peak_bytes"] > 0, line
