"""A distillation teacher served by engines: a cpu engine's input-token log probs (SGLang's contract) are the
model's own, and the orchestrator's teacher scorer retries a teacher that fails, waits for one that is being
replaced, gives up after its budget, and never asks twice for a sample it has scored; under `make chaos`, a
job whose teacher engines are killed and hung trains its student as the fault-free job does."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from aiohttp.test_utils import TestServer
from transformers import AutoModelForCausalLM

from elastic_rl.engines import direct
from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.cpu_engine import CpuEngine
from elastic_rl.engines.cpu_server import build_app
from elastic_rl.engines.direct import DirectEngineClient
from elastic_rl.errors import EngineRejected, GaveUp
from elastic_rl.net import free_port, url
from elastic_rl.rollout import teacher as teacher_module
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.groups import Group, Sample, SampleStatus
from elastic_rl.rollout.teacher import TeacherScorer
from elastic_rl.spec.engines import TeacherEnginesSpec
from tests.integration.erld_support import job_events, metrics, run_job, status
from tests.integration.test_replicas import assert_close_relative, final_weights

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROMPT = [3, 4, 5, 6]
RESPONSES = [[7, 8, 9], [10, 11, 12, 13, 14, 15], [16]]


def expected_logprobs(model, response: list[int]) -> torch.Tensor:
    """What the trainer's teacher pass computes: each response token's log prob after the tokens before it."""
    tokens = torch.tensor([PROMPT + response])
    with torch.no_grad():
        log_probs = model(tokens).logits[0, len(PROMPT) - 1 : -1].log_softmax(-1)
    return log_probs.gather(1, tokens[0, len(PROMPT) :].unsqueeze(1)).squeeze(1)


class Teacher:
    """A cpu engine's server on a checkpoint, in this process, counting the scoring requests it answers."""

    def __init__(self, checkpoint):
        self.answered = 0
        app = build_app(CpuEngine(checkpoint, max_batch_size=8, weight_version="teacher"), {"engine": "test"})

        async def on_response(request, response) -> None:
            if request.path == "/generate" and response.status == 200:
                self.answered += 1

        app.on_response_prepare.append(on_response)
        self.server = TestServer(app, host="127.0.0.1")

    async def __aenter__(self) -> str:
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")

    async def __aexit__(self, *exc_info) -> None:
        await self.server.close()


def new_group() -> Group:
    samples = [Sample(list(response), [0.0] * len(response), [], SampleStatus.COMPLETED) for response in RESPONSES]
    return Group(Prompt(0, 0, "p", "l"), list(PROMPT), samples)


@pytest.fixture
def quick(monkeypatch):
    """Directory reads and backoffs of a fraction of a second, so the test takes no real backoff."""
    monkeypatch.setattr(direct, "DIRECTORY_REFRESH_S", 0.05)
    monkeypatch.setattr(teacher_module, "FIRST_BACKOFF_S", 0.05)
    monkeypatch.setattr(teacher_module, "MAX_BACKOFF_S", 0.1)


def test_a_cpu_engine_scores_a_batch_of_sequences_as_the_model_does(checkpoints):
    v0, _ = checkpoints
    model = AutoModelForCausalLM.from_pretrained(str(v0), dtype=torch.float32).eval()

    async def scored() -> list[list[float]]:
        async with Teacher(v0) as base, EngineClient(base) as client:
            with pytest.raises(EngineRejected, match="logprob_start_len"):
                await client.input_logprobs([PROMPT], [len(PROMPT) + 1])
            return await client.input_logprobs([PROMPT + r for r in RESPONSES], [len(PROMPT)] * len(RESPONSES))

    for logprobs, response in zip(asyncio.run(scored()), RESPONSES):
        assert len(logprobs) == len(response)
        # One padded forward for the batch: each sequence's log probs as its own forward gives them.
        assert (torch.tensor(logprobs) - expected_logprobs(model, response)).abs().max().item() <= 1e-5


def test_the_scorer_retries_a_killed_teacher_waits_for_its_replacement_and_scores_each_sample_once(checkpoints, quick):
    v0, _ = checkpoints
    dead = url(free_port())  # nothing listens there: a teacher engine just killed
    teacher = Teacher(v0)

    async def run() -> tuple[list[Group], TeacherScorer]:
        async with teacher as live:
            reads = 0

            async def directory() -> list[str]:
                # The killed engine still listed, then none while erld restarts it, then its replacement.
                nonlocal reads
                reads += 1
                return [dead] if reads == 1 else [] if reads <= 4 else [live]

            async with DirectEngineClient(directory, timeout_s=10) as client:
                scorer = TeacherScorer(TeacherEnginesSpec(max_failures=2), client)
                groups = [new_group(), new_group()]
                await scorer.score(groups[:1])
                await scorer.score(groups)  # the first group's samples are scored already
                return groups, scorer

    groups, scorer = asyncio.run(run())
    # One request found the killed engine; waiting for the replacement is no failure.
    assert scorer.failures == 1
    assert scorer.scored == 2 * len(RESPONSES) and teacher.answered == 2
    assert [len(sample.teacher_logprobs) for group in groups for sample in group.samples] == [3, 6, 1] * 2


def test_a_teacher_that_keeps_failing_fails_the_job_after_its_budget(quick):
    dead = url(free_port())

    async def run() -> TeacherScorer:
        async def directory() -> list[str]:
            return [dead]

        async with DirectEngineClient(directory, timeout_s=10) as client:
            scorer = TeacherScorer(TeacherEnginesSpec(max_failures=3), client)
            with pytest.raises(GaveUp, match="max_failures"):
                await scorer.score([new_group()])
            return scorer

    assert asyncio.run(run()).failures == 3


def hang(daemon, job: str, proc: str):
    """A fault: stop ``proc`` (SIGSTOP), as a hung engine; erld's health check finds it and replaces it."""

    def stop() -> None:
        os.kill(status(daemon, job)["procs"][proc]["pid"], signal.SIGSTOP)

    stop.__name__ = f"hang-{proc}"
    return stop


@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_teacher_engines_killed_and_hung_leave_the_student_as_a_fault_free_run_trains_it(daemon, tmp_path, checkpoints):
    """Two teacher engines, one killed at rollout 2 and the other hung at rollout 5: both are replaced, the
    requests they broke are sent again, each sample is scored once, and the student's weights end as the
    fault-free run's (deterministic mode: the same samples, and the same teacher log probs from either
    engine)."""
    _, teacher = checkpoints
    overrides = [
        "rollout.num_rollouts=8",
        "engines.count=1",
        "engines.health_timeout_s=2",
        "engines.hang_timeout_s=10",
        f"algorithm.distillation.teacher={teacher}",
        "algorithm.distillation.engines.count=2",
    ]
    job = [arg for override in overrides for arg in ("--set", override)]
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(daemon, clean, job, timeout_s=400)
    injected = run_job(daemon, faulty, job, [("teacher-0", 2), (hang(daemon, "tiny-grpo", "teacher-1"), 5)])
    assert injected == ["teacher-0", "hang-teacher-1"]
    assert_close_relative(final_weights(clean, 8), final_weights(faulty, 8), 1e-5)
    events = job_events(faulty)
    assert {e["proc"] for e in events if e["kind"] == "proc_restarted"} == {"teacher-0", "teacher-1"}
    assert [e["proc"] for e in events if e["kind"] == "engine_unhealthy"] == ["teacher-1"]
    lines = metrics(faulty)
    assert [line["rollout/teacher_scored"] for line in lines] == [line["rollout/samples_used"] for line in lines]
    assert sum(line["rollout/teacher_failures"] for line in lines) > 0
    kl = [line["train/distillation_reverse_kl"] for line in lines]
    assert kl[-1] < kl[0], kl
