"""Checkpoint-first: SIGKILL job processes mid-run; the run ends exactly as a fault-free one, the
rollout buffer's groups (dynamic sampling's leftovers) and PPO's critic included. The router dies
mid-generation, and the rollout goes on straight to the engines. Restarts come from erld's pre-imported
interpreters."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from chaos.faults import inject
from chaos.invariants import check_run
from chaos.runner import generating
from chaos.scenario import Fault, FaultKind
from chaos.topology import Topology
from checkpoints import layout
from checkpoints.discovery import valid_steps
from tests.integration.erld_support import STOP_AND_RESUME, job_events, metrics, run_job, running_daemon, status

pytestmark = [pytest.mark.integration]

ROLLOUTS = 12
# A dead lighthouse costs the trainer one quorum timeout, kept short here. Half the example's
# prompts a rollout (and half its global batch): what is checked does not need more. DAPO's
# filter and over-sampling leave groups in the buffer across rollouts, so the kills find it full.
# Every layer is recomputed in the backward pass: a restart resumes it as any other run. Trained with
# PPO: a killed trainer resumes its critic from the snapshot with the policy.
JOB = [
    "--set",
    "algorithm.advantage_estimator=ppo",
    "--set",
    "trainer.recompute=full",
    "--set",
    f"rollout.num_rollouts={ROLLOUTS}",
    "--set",
    "rollout.prompts_per_rollout=16",
    "--set",
    "rollout.over_sampling_batch_size=24",
    "--set",
    "rollout.dynamic_filter=zero_std",
    "--set",
    "trainer.global_batch_size=128",
    "--set",
    "checkpoints.keep_last=1000",
    "--set",
    "fault_tolerance.quorum_timeout_s=10",
]


def kill_the_router_as(first: int, daemon: Topology, workdir: Path) -> Callable[[], None]:
    """A fault: the router SIGKILLed as soon as the orchestrator begins generating a rollout, the first from
    ``first`` on whose generation has not begun yet (a rollout generates in a quarter of a second here: the
    fault loop's polls are too coarse to land inside it, and on a loaded machine it may call this a rollout
    or two late). The router's pid is read first: `erl status` takes longer than a generation."""

    def kill_the_router_mid_generation() -> None:
        procs = status(daemon, "tiny-grpo")
        rollout_id = first
        while generating(rollout_id)(workdir):
            rollout_id += 1
        assert rollout_id < ROLLOUTS, "the job generated its last rollout before the router's kill"
        begun, deadline = generating(rollout_id), time.monotonic() + 120
        while not begun(workdir):
            assert time.monotonic() < deadline, f"rollout {rollout_id} never began generating"
            time.sleep(0.005)
        router = Fault(kind=FaultKind.KILL, target="router")
        inject(router, daemon, procs, workdir, random.Random(0))

    return kill_the_router_mid_generation


def critic_in_snapshot(workdir: Path, step: int, scratch: Path) -> dict:
    """The critic's entries (``critic.``: weights, AdamW state, schedule) of the run's snapshot ``step``."""
    whole = scratch / f"{workdir.name}-{step}.pt"
    dcp_to_torch_save(layout.snapshot_path(workdir, step), whole)
    return {name: value for name, value in torch.load(whole, weights_only=False).items() if name.startswith("critic.")}


# One idle interpreter of each pooled kind: each kill below is restarted from one.
POOL = {"trainer": 1, "orchestrator": 1, "engine": 1}


@pytest.fixture
def pooled_daemon(tmp_path):
    with running_daemon(tmp_path, pool=POOL) as topology:
        yield topology


@pytest.mark.timeout(900)
def test_killing_any_job_process_changes_nothing(pooled_daemon, tmp_path):
    daemon = pooled_daemon
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(daemon, clean, JOB)
    schedule = [
        ("trainer-0-0", 2),
        # Mid-generation: the requests in flight go on straight to the engines. The orchestrator's kill
        # waits a few rollouts, or it could take the direct requests' rollout with it, uncommitted.
        (kill_the_router_as(4, daemon, faulty), 3),
        ("orchestrator", 6),
        ("lighthouse", 7),
        ("engine-0", 8),
        (STOP_AND_RESUME, 9),
        ("trainer-0-0", 10),
    ]
    killed = run_job(daemon, faulty, JOB, schedule)
    assert len(killed) == len(schedule), killed

    # Every invariant: the same prompts drawn once, every rollout committed and trained once, whole
    # global batches, weights bitwise equal to the fault-free run's.
    checks = check_run(faulty, clean, status(daemon, "tiny-grpo")["status"], tolerance=0.0)
    assert all(check.held for check in checks), [check for check in checks if not check.held]
    # The critic too, its AdamW moments and schedule with it, in the newest snapshot both runs took.
    step = max(set(valid_steps(clean)) & set(valid_steps(faulty)))
    assert step > 0
    clean_critic, faulty_critic = (critic_in_snapshot(run, step, tmp_path) for run in (clean, faulty))
    assert any(name.startswith("critic.optim.") for name in clean_critic)
    assert clean_critic.keys() == faulty_critic.keys()
    for name, value in clean_critic.items():
        assert torch.equal(faulty_critic[name], value) if torch.is_tensor(value) else faulty_critic[name] == value, name
    lines = metrics(faulty)
    # While the router was down, samples kept coming: straight from the engines.
    assert sum(line["rollout/direct_requests"] for line in lines) > 0
    assert not any(line["rollout/direct_requests"] for line in metrics(clean))
    assert any(line["rollout/filtered_fraction"] > 0 for line in lines)
    assert any(line["rollout/groups_from_buffer"] > 0 for line in lines)
    events = job_events(faulty)
    assert [e["kind"] for e in events].count("job_stopped") == 1
    assert any(e["kind"] == "trainer_resumed" and e["proc"] == "trainer-0-0" for e in events)
    # A killed trainer rank, orchestrator and cpu engine each became a pre-imported interpreter.
    restarts = [e for e in events if e["kind"] == "proc_restarted"]
    for proc in ("trainer-0-0", "orchestrator", "engine-0"):
        mine = [e for e in restarts if e["proc"] == proc]
        assert mine and all(e["from_pool"] for e in mine), (proc, mine)
