"""Engine health under erld: a SIGKILLed and a SIGSTOPped engine mid-rollout are replaced; no group is lost."""

from __future__ import annotations

import random
import signal
from collections import Counter

import pytest
from safetensors.torch import load_file

from elastic_rl import jobenv
from tests.integration.erld_support import job_events, metrics, run_job

pytestmark = [pytest.mark.integration]

ROLLOUTS = 8
PROMPTS, SAMPLES = 32, 16  # the example's rollout: 32 prompts x 16 samples


def engine_job() -> list[str]:
    return [
        "--set", f"rollout.num_rollouts={ROLLOUTS}",
        "--set", "engines.health_interval_s=1",
        "--set", "engines.health_timeout_s=1",
    ]  # fmt: skip


def generations_after_last_start(log_text: str) -> int:
    """/generate requests the newest process writing to this engine log has served."""
    newest = log_text.rsplit(" serving ", 1)[-1]
    return newest.count('"POST /generate HTTP/1.1" 200')


def assert_every_group_complete(workdir) -> None:
    assert [line["rollout"] for line in metrics(workdir)] == list(range(ROLLOUTS))
    for rollout_id in jobenv.committed_rollouts(workdir):
        batch = load_file(str(jobenv.rollout_dir(workdir, rollout_id) / "batch.safetensors"))
        groups = batch["prompt_indices"].view(PROMPTS, SAMPLES)
        assert (groups == groups[:, :1]).all(), rollout_id  # each group whole, its samples together
        assert batch["response_lengths"].min() >= 1, rollout_id


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_a_failed_engine_is_replaced_mid_rollout(daemon, tmp_path, sig):
    # A random part of a second into the rollout: the engine dies (or hangs) mid-generation.
    done = run_job(daemon, tmp_path, engine_job(), [("engine-0", 3)], jitter=random.Random(sig), signal_number=sig)
    assert done == ["engine-0"]
    assert_every_group_complete(tmp_path)
    events = job_events(tmp_path)
    kinds = Counter(e["kind"] for e in events if e.get("proc") == "engine-0")
    # Found by its exit, or (a hung engine) by the health check's timeout; replaced once, then serving.
    assert kinds["proc_restarted"] == 1 and kinds["engine_serving"] == 1, kinds
    if sig == signal.SIGSTOP:
        assert kinds["engine_unhealthy"] == 1, kinds
    replacement_served = generations_after_last_start((tmp_path / "logs" / "engine-0.log").read_text())
    assert replacement_served > 0
