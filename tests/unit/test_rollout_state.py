"""The orchestrator's state in the rollout log: what it commits with a rollout and restores on a
restart (the bad-data count included), what it reports (stale groups), what a replay
(debug.train_only) loads, and a log of another format refused by name. Generation is the fake
router of test_dynamic_sampling."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from checkpoints import layout
from checkpoints.rollout_log import batch_rows, read_rollout, write_rollout
from elastic_rl.cli.main import main
from elastic_rl.engines.access import EngineAccess
from elastic_rl.engines.router import RouterClient
from elastic_rl.errors import GaveUp, RolloutLogError, SpecError
from elastic_rl.jobenv import JobEnv
from elastic_rl.progress import ProgressReporter
from elastic_rl.rollout.orchestrator import Orchestrator
from elastic_rl.spec.loading import validate_spec
from tests.processes import SPEC
from tests.unit.test_dynamic_sampling import FakeRouter, group

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

UNIMPORTABLE = "no_such_module_of_the_user:function"


def spec(**fields):
    rollout = {
        "prompts_per_rollout": 4,
        "n_samples_per_prompt": 4,
        "max_new_tokens": 1,
        "deterministic": True,
        "num_rollouts": 2,
        **fields.pop("rollout", {}),
    }
    return validate_spec(
        {
            "name": "t",
            "data": {"task": "toy_copy", "num_prompts": 64},
            "rollout": rollout,
            "trainer": {"global_batch_size": 16, "micro_batch_size": 16},
            **fields,
        }
    )


class RecordingProgress(ProgressReporter):
    """The orchestrator's progress reporter outside erld, keeping the events it is given."""

    def __init__(self, workdir):
        super().__init__("t", None, workdir)
        self.events: list[tuple[str, dict]] = []

    async def event(self, kind, message, **fields):
        self.events.append((kind, fields))


def orchestrator(job, workdir) -> Orchestrator:
    # No router runs: the sampler's requests go to the fake below, and no request is direct.
    engines = EngineAccess(RouterClient("http://127.0.0.1:9"))
    made = Orchestrator(JobEnv("t", workdir, job), engines, RecordingProgress(workdir), None)
    if made.sampler is not None:
        made.sampler.generator.router = FakeRouter(made.tokenizer)
    return made


def commit(made: Orchestrator, workdir, rollout_id: int) -> dict:
    """Generate a rollout in sync mode, as if the engines had loaded its weights, and commit it."""
    made.engine_version = made.sampler.generator.router.version = rollout_id
    batch, meta = asyncio.run(made.generate_rollout(rollout_id, weights_wait=0.0, load_time=0.0))
    write_rollout(workdir, rollout_id, batch, meta)
    return meta


def test_the_bad_data_count_is_committed_and_restored(tmp_path):
    job = spec(rollout={"max_consecutive_bad_samples": 8, "over_sampling_batch_size": 8})
    first = orchestrator(job, tmp_path)
    calls = iter(range(10_000))
    toy_copy = first.sampler.scorer.rule
    # The last of the round's 32 samples cannot be scored: the rollout ends one bad sample into a row.
    first.sampler.scorer.rule = lambda *args: float("nan") if next(calls) == 31 else toy_copy(*args)
    assert commit(first, tmp_path, 0)["bad_samples_in_a_row"] == 1

    restarted = orchestrator(job, tmp_path)
    assert restarted.resume_point() == 1
    assert restarted.sampler.bad_data.count == 1
    restarted.sampler.scorer.rule = lambda *args: float("nan")
    with pytest.raises(GaveUp, match="8 samples in a row could not be scored"):
        asyncio.run(restarted.sampler.fill(1))
    assert restarted.sampler.bad_data.count == 8  # 7 more after the restart, not 8


def test_stale_groups_are_counted_and_reported(tmp_path):
    made = orchestrator(spec(rollout={"over_sampling_batch_size": 8}), tmp_path)
    made.sampler.buffer.add([group(60, [1.0, 0.0, 0.0, 0.0], version=0)])
    _, filled = asyncio.run(made.fill(2))
    assert filled.metrics["rollout/stale_groups"] == 1
    assert made.progress.events == [("stale_groups_dropped", {"rollout": 2, "prompts": [[60, 0]]})]


def test_a_replay_imports_no_user_function_and_commits_the_source_rollouts(tmp_path):
    source, replay = tmp_path / "source", tmp_path / "replay"
    generating = orchestrator(spec(), source)
    for rollout_id in range(2):
        commit(generating, source, rollout_id)
    users = {"reward": UNIMPORTABLE, "dynamic_filter": UNIMPORTABLE, "buffer_filter": UNIMPORTABLE}
    with pytest.raises(SpecError, match="rollout.reward: cannot load"):
        orchestrator(spec(rollout=users), replay)

    replaying = orchestrator(spec(rollout=users, debug={"train_only": str(source)}), replay)
    assert replaying.sampler is None
    (replay / "metrics").mkdir(parents=True)
    for rollout_id in range(2):  # as the trainers would, once they applied each
        layout.train_metrics_path(replay, rollout_id).write_bytes(orjson.dumps({"train/loss": 0.5}))
    asyncio.run(asyncio.wait_for(replaying.run(), timeout=30))
    assert layout.committed_rollouts(replay) == [0, 1]
    for rollout_id in range(2):
        (theirs, their_meta), (mine, my_meta) = read_rollout(source, rollout_id), read_rollout(replay, rollout_id)
        assert mine.tokens.equal(theirs.tokens) and my_meta["drawn_prompts"] == their_meta["drawn_prompts"]


def test_a_rollout_log_of_another_format_is_refused_with_what_to_do(tmp_path, capsys):
    made = orchestrator(spec(), tmp_path)
    commit(made, tmp_path, 0)
    meta_path = layout.rollout_dir(tmp_path, 0) / layout.META_FILE
    meta = orjson.loads(meta_path.read_bytes())
    del meta["format"], meta["bad_samples_in_a_row"]  # as the version before the format number wrote it
    meta_path.write_bytes(orjson.dumps(meta))

    why = f"{meta_path}: a rollout log of format 1, written by another version .* run the job in a new work dir"
    with pytest.raises(RolloutLogError, match=why):
        orchestrator(spec(), tmp_path).resume_point()
    with pytest.raises(RolloutLogError, match=why):
        batch_rows(tmp_path, 0)
    # Replaying it is refused before the job starts, with exit code 2.
    code = main(["validate", str(SPEC), "--set", "rollout.num_rollouts=1", "--set", f"debug.train_only={tmp_path}"])
    assert code == 2 and "a rollout log of format 1" in capsys.readouterr().err
