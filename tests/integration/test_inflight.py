"""No generated token lost: generations in flight when an engine dies or hangs, the router dies, or the
orchestrator dies, are continued from the tokens they had, and the run ends bitwise equal to a fault-free
one (tiny model, long responses, deterministic engines), every token from its rollout's weights and every
log prob the trainer's. One erld runs the fault-free reference and each faulty run."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from chaos.faults import inject
from chaos.invariants import check_run
from chaos.scenario import Fault, FaultKind
from chaos.topology import Topology
from checkpoints import layout
from elastic_rl.engines import token_ledger
from tests.integration.erld_support import job_events, metrics, run_job, running_daemon, status

pytestmark = [pytest.mark.integration]

NEW_TOKENS = 200
PERSIST_INTERVAL_S = 0.25
HANG_TIMEOUT_S = 4
# Long responses on the tiny model: every one runs to max_new_tokens, so a kill finds them mid-way.
LONG_JOB = [
    "--set",
    "rollout.num_rollouts=4",
    "--set",
    "rollout.prompts_per_rollout=4",
    "--set",
    "rollout.n_samples_per_prompt=4",
    "--set",
    f"rollout.max_new_tokens={NEW_TOKENS}",
    "--set",
    "rollout.ignore_eos=true",
    "--set",
    f"rollout.inflight_persist_interval_s={PERSIST_INTERVAL_S}",
    "--set",
    "model.max_position_embeddings=256",
    "--set",
    f"engines.hang_timeout_s={HANG_TIMEOUT_S}",
    "--set",
    "trainer.global_batch_size=16",
    "--set",
    "trainer.micro_batch_size=16",
    "--set",
    "checkpoints.keep_last=1000",
]


def mid_generation(rollout_id: int):
    """A moment: rollout ``rollout_id``'s samples have streamed some of their tokens (the in-flight log
    has them), and none has finished."""

    def moment(workdir: Path) -> bool:
        path = layout.inflight_path(workdir, rollout_id)
        lines = path.read_bytes().splitlines() if path.is_file() else []
        return len(lines) >= 4 and not any(b'"end"' in line for line in lines)

    return moment


def continued_samples(workdir: Path, rollout_id: int) -> int:
    """The rollout's samples made of more than one request's tokens (in sync mode without partial
    rollout, only a continuation after a fault makes those)."""
    meta = orjson.loads((layout.rollout_dir(workdir, rollout_id) / layout.META_FILE).read_bytes())
    return sum(len(sample["segments"]) > 1 for sample in meta["samples"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Topology, Path]:
    """An erld, and the job's fault-free run on it."""
    root = tmp_path_factory.mktemp("inflight")
    with running_daemon(root) as daemon:
        run_job(daemon, root / "clean", LONG_JOB)
        yield daemon, root / "clean"


def hang(engine: str, daemon: Topology, workdir: Path) -> Callable[[], None]:
    """A fault: ``engine`` SIGSTOPped for good (erld finds it hung and replaces it)."""

    def hang_engine() -> None:
        fault = Fault(kind=FaultKind.HANG, target=engine, duration_s=3600)
        inject(fault, daemon, status(daemon, "tiny-grpo"), workdir, random.Random(0))

    return hang_engine


@pytest.mark.timeout(400)
def test_an_engine_or_the_router_killed_or_an_engine_hung_mid_generation_loses_no_token(reference, tmp_path):
    daemon, clean = reference
    faulty = tmp_path / "faulty"
    schedule = [
        ("engine-0", mid_generation(1)),
        ("router", mid_generation(2)),
        (hang("engine-1", daemon, faulty), mid_generation(3)),
    ]
    assert run_job(daemon, faulty, LONG_JOB, schedule) == ["engine-0", "router", "hang_engine"]

    checks = check_run(faulty, clean, status(daemon, "tiny-grpo")["status"], tolerance=0.0)
    assert all(check.held for check in checks), [check for check in checks if not check.held]
    lines = metrics(faulty)
    # Continued in each rollout, and every token the orchestrator received it kept: none came twice.
    assert all(continued_samples(faulty, rollout_id) > 0 for rollout_id in (1, 2, 3))
    assert not any(continued_samples(clean, rollout_id) for rollout_id in range(4))
    assert sum(line["rollout/regenerated_tokens"] for line in lines) == 0
    events = job_events(faulty)
    assert any(e["kind"] == "proc_restarted" and e["proc"] == "engine-0" for e in events)
    assert any(e["kind"] == "proc_restarted" and e["proc"] == "router" for e in events)
    assert any(e["kind"] == "engine_unhealthy" and e["proc"] == "engine-1" for e in events)
    # The engines generated no more than the fault-free run's (less what the dead ones made after erld
    # last read their counts).
    assert token_ledger.total(faulty) <= token_ledger.total(clean)


@pytest.mark.timeout(400)
def test_an_orchestrator_killed_mid_generation_is_continued_by_its_successor(reference, tmp_path):
    daemon, clean = reference
    faulty = tmp_path / "faulty"
    assert run_job(daemon, faulty, LONG_JOB, [("orchestrator", mid_generation(2))]) == ["orchestrator"]

    checks = check_run(faulty, clean, status(daemon, "tiny-grpo")["status"], tolerance=0.0)
    assert all(check.held for check in checks), [check for check in checks if not check.held]
    lines = metrics(faulty)
    # The successor took the samples of rollout 2 up from what its predecessor had logged.
    assert lines[2]["rollout/resumed_tokens"] > 0
    assert not any(line["rollout/resumed_tokens"] for line in metrics(clean))
    # What the engines generated again: what arrived after the last persist, and what they made before
    # they saw the dead orchestrator's requests go; at most about one persist interval's worth at the
    # engines' speed around the kill. Rollout 2's own rate counts the time its successor took to take over,
    # and a test running beside this one can halve either rollout's: the faster of rollouts 1 and 2.
    regenerated = token_ledger.total(faulty) - token_ledger.total(clean)
    rate = max(line["perf/generated_tokens_per_sec"] for line in lines[1:3])
    assert 0 <= regenerated <= rate * PERSIST_INTERVAL_S * 2, (regenerated, rate)
