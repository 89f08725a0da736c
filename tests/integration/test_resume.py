"""Checkpoint-first: SIGKILL job processes mid-run; the run ends exactly as a fault-free one."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import torch
from safetensors.torch import load_file

from elastic_rl import jobenv
from tests.integration.erld_support import erl, metrics, status
from tests.processes import SPEC

pytestmark = [pytest.mark.integration]

ROLLOUTS = 16
# Keep every snapshot and rollout so the test can read the whole log afterwards; a dead
# lighthouse costs the trainer one quorum timeout, kept short here.
JOB = [
    "--set", f"rollout.num_rollouts={ROLLOUTS}",
    "--set", "checkpoints.keep_last=1000",
    "--set", "fault_tolerance.quorum_timeout_s=10",
]  # fmt: skip
STOP_AND_RESUME = "erl stop + erl resume"


def wait_phase(daemon, phases: tuple[str, ...], deadline: float) -> dict:
    while (info := status(daemon, "tiny-grpo"))["status"]["phase"] not in phases:
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    return info


def run_job(daemon, workdir: Path, faults: list[tuple[str, int]] = (), jitter: random.Random | None = None) -> list[str]:
    """Run the job to the end, injecting fault F once `rollouts_done` reaches N, for each (F, N).

    A fault is a job process's name (SIGKILLed), "erld" (SIGKILLed and started again)
    or STOP_AND_RESUME. ``jitter`` delays each fault by a random part of a second, so
    kills land anywhere in a rollout: mid-generation, mid-commit, mid-snapshot.
    """
    erl("submit", str(SPEC), *JOB, "--workdir", str(workdir), "--etcd", daemon.endpoint, check=True)
    done = []
    deadline = time.monotonic() + 500
    pending = list(faults)
    while (info := status(daemon, "tiny-grpo"))["status"]["phase"] in ("pending", "running"):
        if pending and info["progress"].get("rollouts_done", 0) >= pending[0][1]:
            fault, _ = pending.pop(0)
            if jitter is not None:
                time.sleep(jitter.uniform(0, 0.8))
            if fault == "erld":
                daemon.process.kill()
                daemon.process.wait(timeout=10)
                daemon.start()
                daemon.wait_ready(daemon.notify)
                done.append(fault)
            elif fault == STOP_AND_RESUME:
                erl("stop", "tiny-grpo", "--etcd", daemon.endpoint, check=True)
                wait_phase(daemon, ("stopped",), deadline)
                erl("resume", "tiny-grpo", "--etcd", daemon.endpoint, check=True)
                done.append(fault)
            elif (proc := info["procs"].get(fault, {})).get("state") == "running":
                os.kill(proc["pid"], signal.SIGKILL)
                done.append(fault)
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.2)
    assert info["status"]["phase"] == "succeeded", info
    return done


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
    run_job(daemon, clean)
    schedule = [("trainer-0-0", 3), ("router", 5), ("orchestrator", 7), ("lighthouse", 9), ("engine-0", 11),
                (STOP_AND_RESUME, 12), ("trainer-0-0", 14)]  # fmt: skip
    killed = run_job(daemon, faulty, schedule)
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
    events = [orjson.loads(line) for line in (faulty / "events.jsonl").read_text().splitlines()]
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
    run_job(daemon, clean)
    done = run_job(daemon, faulty, schedule, jitter=random.Random(seed))
    assert done, schedule
    expected = load_file(str(jobenv.weights_dir(clean, ROLLOUTS) / "model.safetensors"))
    actual = load_file(str(jobenv.weights_dir(faulty, ROLLOUTS) / "model.safetensors"))
    for name in expected:
        assert torch.equal(expected[name], actual[name]), (name, schedule)
    assert drawn_prompts(faulty) == drawn_prompts(clean)
    commits = Counter(re.findall(r"rollout (\d+) committed", (faulty / "logs" / "orchestrator.log").read_text()))
    assert set(commits.values()) == {1}, (commits, schedule)
    assert [line["rollout"] for line in metrics(faulty)] == list(range(ROLLOUTS)), schedule
