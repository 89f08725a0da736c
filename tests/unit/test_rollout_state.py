"""The orchestrator's state in the rollout log: what it reports (stale groups). Generation is the fake
router of test_dynamic_sampling."""

from __future__ import annotations

import asyncio

import pytest

from elastic_rl.config import validate_spec
from elastic_rl.jobenv import JobEnv
from elastic_rl.rollout.orchestrator import Orchestrator
from elastic_rl.rollout.progress import ProgressReporter
from tests.unit.test_dynamic_sampling import FakeRouter, group

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def spec(**fields):
    rollout = {"prompts_per_rollout": 4, "n_samples_per_prompt": 4, "max_new_tokens": 1, "deterministic": True,
               "num_rollouts": 2, **fields.pop("rollout", {})}  # fmt: skip
    return validate_spec({
        "name": "t",
        "data": {"task": "toy_copy", "num_prompts": 64},
        "rollout": rollout,
        "trainer": {"global_batch_size": 16, "micro_batch_size": 16},
        **fields,
    })  # fmt: skip


class RecordingProgress(ProgressReporter):
    """The orchestrator's progress reporter outside erld, keeping the events it is given."""

    def __init__(self, workdir):
        super().__init__("t", None, workdir)
        self.events: list[tuple[str, dict]] = []

    async def event(self, kind, message, **fields):
        self.events.append((kind, fields))


def orchestrator(job, workdir) -> Orchestrator:
    made = Orchestrator(JobEnv("t", workdir, job), None, RecordingProgress(workdir), None)
    made.sampler.generator.router = FakeRouter(made.tokenizer)
    return made


def test_stale_groups_are_counted_and_reported(tmp_path):
    made = orchestrator(spec(rollout={"over_sampling_batch_size": 8}), tmp_path)
    made.sampler.buffer.add([group(60, [1.0, 0.0, 0.0, 0.0], version=0)])
    _, filled = asyncio.run(made.fill(2))
    assert filled.metrics["rollout/stale_groups"] == 1
    assert made.progress.events == [("stale_groups_dropped", {"rollout": 2, "prompts": [[60, 0]]})]
