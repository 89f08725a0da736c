"""Engine health under erld: a SIGKILLed and a SIGSTOPped engine mid-rollout are replaced; no group is lost."""

from __future__ import annotations

import random
import signal
from collections import Counter

import pytest
from safetensors.torch import load_file

from elastic_rl import jobenv
from tests.integration.erld_support import erl, job_events, metrics, run_job, status

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


@pytest.mark.timeout(400)
def test_scaling_engines_of_a_running_job(daemon, tmp_path):
    def scale_up() -> None:
        erl("scale", "tiny-grpo", "--engines", "3", "--etcd", daemon.endpoint, check=True)

    def scale_down() -> None:
        erl("scale", "tiny-grpo", "--engines", "1", "--etcd", daemon.endpoint, check=True)

    def third_engine_serving(workdir) -> bool:
        return any(e["kind"] == "engine_serving" and e["proc"] == "engine-2" for e in job_events(workdir))

    done = run_job(daemon, tmp_path, engine_job(), [(scale_up, 1), (scale_down, third_engine_serving)])
    assert done == ["scale_up", "scale_down"]
    assert_every_group_complete(tmp_path)
    scaled = [e["message"] for e in job_events(tmp_path) if e["kind"] == "engines_scaled"]
    assert scaled == ["2 -> 3 engines", "3 -> 1 engines"]
    # The added engine took requests; after the scale-down one engine is left.
    assert generations_after_last_start((tmp_path / "logs" / "engine-2.log").read_text()) > 0
    procs = status(daemon, "tiny-grpo")["procs"]
    assert [name for name in procs if name.startswith("engine")] == ["engine-0"]
    finished = erl("scale", "tiny-grpo", "--engines", "2", "--etcd", daemon.endpoint)
    assert finished.returncode == 1 and "only a pending or running job scales" in finished.stderr
    invalid = erl("scale", "tiny-grpo", "--engines", "0", "--etcd", daemon.endpoint)
    assert invalid.returncode == 2 and "--engines" in invalid.stderr
