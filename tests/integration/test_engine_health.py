"""Engine health under erld: an engine SIGKILLed mid-rollout while the job scales is replaced; no group
is lost. Every engine slowed at once is load, not a fault, and restarts none; an engine hung for good
is still replaced. (A hung only engine is also the chaos scenario chaos/scenarios/engine-hang.yaml:
tests/integration/test_chaos.py.)"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from safetensors.torch import load_file

from chaos.faults import inject
from chaos.scenario import Fault, FaultKind
from checkpoints import layout
from tests.integration.erld_support import erl, job_events, metrics, overload_engines, run_job, status

pytestmark = [pytest.mark.integration]

ROLLOUTS = 8
SCALE_ROLLOUTS = 14
OVERLOAD_ROLLOUTS = 26
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
        # A count outside the job's range (2) is refused, naming the flag for a new range; so is a minimum
        # more than the node's 8 device slots hold; the record keeps the real sizes.
        outside = erl("scale", "tiny-grpo", "--engines", "3", "--etcd", daemon.endpoint)
        assert outside.returncode == 2 and "range 2..2" in outside.stderr and "--engines MIN:MAX" in outside.stderr
        refused = erl("scale", "tiny-grpo", "--engines", "9:9", "--etcd", daemon.endpoint)
        assert refused.returncode == 2 and "ask for at most 7" in refused.stderr, refused.stderr
        assert "sizes" not in status(daemon, "tiny-grpo")["status"]
        scaled = erl("scale", "tiny-grpo", "--engines", "2:3", "--etcd", daemon.endpoint, check=True)
        assert "engines 2 -> 2..3" in scaled.stdout

    def scale_down() -> None:
        erl("scale", "tiny-grpo", "--engines", "1:1", "--etcd", daemon.endpoint, check=True)

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
    neither = erl("scale", "tiny-grpo", "--etcd", daemon.endpoint)
    assert neither.returncode == 2 and "--replicas or --engines" in neither.stderr


@pytest.mark.timeout(500)
def test_overload_restarts_no_engine_and_a_hung_engine_is_still_replaced(daemon, tmp_path):
    """Both engines stall in SIGSTOP bursts (3 s of every 4, each burst shorter than the hang timeout)
    for 24 s while rollouts run: every answer between the bursts shows generation going on, so no
    engine is restarted. Then engine-1 is SIGSTOPped for good: replaced within the hang timeout and
    one check."""
    hang_timeout_s, interval_s, check_timeout_s = 10, 1, 2
    overload_ends: list[float] = []
    hung_at: list[float] = []

    def overload() -> None:
        overload_ends.append(overload_engines(daemon, "tiny-grpo", tmp_path, ["engine-0", "engine-1"], 24))

    def hang_engine_1() -> None:
        hang = Fault(kind=FaultKind.HANG, target="engine-1", duration_s=3600)
        hung_at.append(inject(hang, daemon, status(daemon, "tiny-grpo"), tmp_path, random.Random(0)).time)

    def overload_over(workdir) -> bool:
        return bool(overload_ends) and time.time() > max(overload_ends) + 1

    # Rollouts enough that the hang comes while the job still generates, and that the job still runs once
    # the replacement serves (the hang's timeout and a cold start later: about ten rollouts on the other
    # engine).
    job = engine_job(rollouts=OVERLOAD_ROLLOUTS) + ["--set", f"engines.hang_timeout_s={hang_timeout_s}"]
    done = run_job(daemon, tmp_path, job, [(overload, 1), (hang_engine_1, overload_over)])
    assert done == ["overload", "hang_engine_1"]
    assert_every_group_complete(tmp_path, OVERLOAD_ROLLOUTS)
    events = [e for e in job_events(tmp_path) if (e.get("proc") or "").startswith("engine")]
    before_the_hang = [e for e in events if e["time"] < hung_at[0]]
    assert not [e for e in before_the_hang if e["kind"] in ("engine_unhealthy", "proc_exited", "proc_restarted")]
    (unhealthy,) = [e for e in events if e["kind"] == "engine_unhealthy"]
    assert unhealthy["proc"] == "engine-1" and "answered nothing" in unhealthy["message"]
    # Found at the first check after the timeout: one interval, plus that check's own wait for an answer.
    assert unhealthy["time"] - hung_at[0] <= hang_timeout_s + interval_s + check_timeout_s + 3
    kinds = Counter((e["proc"], e["kind"]) for e in events)
    assert kinds[("engine-1", "proc_restarted")] == 1 and kinds[("engine-1", "engine_serving")] == 1, kinds
    assert not [e for e in events if e["proc"] == "engine-0" and e["kind"] != "engine_serving"]
