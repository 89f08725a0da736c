"""Engine health under erld: an engine SIGKILLed mid-rollout while the job scales is replaced; no group
is lost. (A hung engine is the chaos scenario chaos/scenarios/engine-hang.yaml: tests/integration/test_chaos.py.)"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from safetensors.torch import load_file

from checkpoints import layout
from tests.integration.erld_support import erl, job_events, metrics, run_job, status

pytestmark = [pytest.mark.integration]

ROLLOUTS = 8
SCALE_ROLLOUTS = 14
PROMPTS, SAMPLES = 32, 16  # the example's rollout: 32 prompts x 16 samples


def engine_job(rollouts: int = ROLLOUTS, engines: int = 2) -> list[str]:
    return [
        "--set",
        f"rollout.num_rollouts={rollouts}",
        "--set",
        f"engines.count={engines}",
        "--set",
        "engines.health_interval_s=1",
        "--set",
        "engines.health_timeout_s=2",
    ]


def generations_after_last_start(log_text: str) -> int:
    """/generate requests the newest process writing to this engine log has served."""
    newest = log_text.rsplit(" serving ", 1)[-1]
    return newest.count('"POST /generate HTTP/1.1" 200')


def assert_every_group_complete(workdir, rollouts: int = ROLLOUTS) -> None:
    assert [line["rollout"] for line in metrics(workdir)] == list(range(rollouts))
    for rollout_id in layout.committed_rollouts(workdir):
        batch = load_file(str(layout.rollout_dir(workdir, rollout_id) / "batch.safetensors"))
        groups = batch["prompt_indices"].view(PROMPTS, SAMPLES)
        assert (groups == groups[:, :1]).all(), rollout_id  # each group whole, its samples together
        assert batch["response_lengths"].min() >= 1, rollout_id


@pytest.mark.timeout(400)
def test_engines_scale_and_a_killed_engine_is_replaced(daemon, tmp_path):
    """`erl scale` up to 3 engines; engine-0 SIGKILLed mid-rollout; then down to 1 engine."""

    def scale_up() -> None:
        # More engines than the node's 8 device slots hold is refused, and the record keeps the real count.
        refused = erl("scale", "tiny-grpo", "--engines", "9", "--etcd", daemon.endpoint)
        assert refused.returncode == 2 and "ask for at most 7" in refused.stderr, refused.stderr
        assert "engines" not in status(daemon, "tiny-grpo")["status"]
        scaled = erl("scale", "tiny-grpo", "--engines", "3", "--etcd", daemon.endpoint, check=True)
        assert "engines 2 -> 3" in scaled.stdout

    def scale_down() -> None:
        erl("scale", "tiny-grpo", "--engines", "1", "--etcd", daemon.endpoint, check=True)

    def both_serving(workdir) -> bool:
        restarted = [e for e in job_events(workdir) if e["kind"] == "engine_serving"]
        return {e["proc"] for e in restarted} >= {"engine-0", "engine-2"}

    # Scaling up and replacing the killed engine-0 overlap; scale down once both serve.
    faults = [(scale_up, 1), ("engine-0", 2), (scale_down, both_serving)]
    done = run_job(daemon, tmp_path, engine_job(SCALE_ROLLOUTS), faults, jitter=random.Random(1))
    assert done == ["scale_up", "engine-0", "scale_down"]
    assert_every_group_complete(tmp_path, SCALE_ROLLOUTS)
    events = job_events(tmp_path)
    assert [e["message"] for e in events if e["kind"] == "engines_scaled"] == ["2 -> 3 engines", "3 -> 1 engines"]
    # The killed engine was found (by its exit, or by a health check that got no answer, whichever
    # came first), replaced, and its replacement served; so did the added engine.
    kinds = Counter(e["kind"] for e in events if e.get("proc") == "engine-0")
    assert kinds["proc_exited"] + kinds["engine_unhealthy"] == 1, kinds
    assert kinds["proc_restarted"] == 1 and kinds["engine_serving"] == 1, kinds
    for engine in ("engine-0", "engine-2"):
        assert generations_after_last_start((tmp_path / "logs" / f"{engine}.log").read_text()) > 0, engine
    # After the scale-down one engine is left.
    procs = status(daemon, "tiny-grpo")["procs"]
    assert [name for name in procs if name.startswith("engine")] == ["engine-0"]
    finished = erl("scale", "tiny-grpo", "--engines", "2", "--etcd", daemon.endpoint)
    assert finished.returncode == 1 and "only a running job scales" in finished.stderr
    invalid = erl("scale", "tiny-grpo", "--engines", "0", "--etcd", daemon.endpoint)
    assert invalid.returncode == 2 and "--engines" in invalid.stderr
