"""Checkpoint-first: SIGKILL job processes mid-run; the run ends exactly as a fault-free one."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elastic_rl import jobenv
from tests.integration.erld_support import erl, status
from tests.processes import SPEC

pytestmark = [pytest.mark.integration]

ROLLOUTS = 16
# Keep every snapshot and rollout so the test can read the whole log afterwards.
JOB = ["--set", f"rollout.num_rollouts={ROLLOUTS}", "--set", "checkpoints.keep_last=1000"]


def run_job(daemon, workdir: Path, kills: list[tuple[str, int]] = ()) -> list[str]:
    """Run the job to the end, SIGKILLing process P once `rollouts_done` reaches N, for each (P, N)."""
    erl("submit", str(SPEC), *JOB, "--workdir", str(workdir), "--etcd", daemon.endpoint, check=True)
    killed = []
    deadline = time.monotonic() + 400
    pending = list(kills)
    while True:
        info = status(daemon, "tiny-grpo")
        if info["status"]["phase"] != "running" and info["status"]["phase"] != "pending":
            break
        if pending and info["progress"].get("rollouts_done", 0) >= pending[0][1]:
            name, _ = pending.pop(0)
            proc = info["procs"].get(name, {})
            if proc.get("state") == "running" and proc.get("pid"):
                os.kill(proc["pid"], signal.SIGKILL)
                killed.append(name)
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.2)
    assert info["status"]["phase"] == "succeeded", info
    return killed


def drawn_prompts(workdir: Path) -> list[tuple[int, int]]:
    """(epoch, dataset index) of every prompt of every committed rollout, in order."""
    drawn = []
    for rollout_id in jobenv.committed_rollouts(workdir):
        batch = load_file(str(jobenv.rollout_dir(workdir, rollout_id) / "batch.safetensors"))
        pairs = list(zip(batch["prompt_epochs"].tolist(), batch["prompt_indices"].tolist()))
        drawn += pairs[:: 16]  # one entry per GRPO group (n_samples_per_prompt = 16)
    return drawn


@pytest.mark.timeout(900)
def test_killing_trainer_orchestrator_and_engine_changes_nothing(daemon, tmp_path):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(daemon, clean)
    killed = run_job(daemon, faulty, [("trainer-0-0", 4), ("orchestrator", 8), ("engine-0", 11), ("trainer-0-0", 13)])
    assert len(killed) == 4, killed

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
    commits = Counter(re.findall(r"rollout (\d+) committed", (faulty / "logs" / "orchestrator.log").read_text()))
    assert set(commits.values()) == {1}, commits
