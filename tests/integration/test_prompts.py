"""Prompts longer than rollout.max_prompt_len are skipped, recorded and counted; the job goes on."""

from __future__ import annotations

import orjson
import pytest
from safetensors.torch import load_file

from elastic_rl import jobenv
from tests.integration.erld_support import job_events, metrics, run_job

pytestmark = [pytest.mark.integration]

ROLLOUTS = 3


@pytest.mark.timeout(300)
def test_over_long_prompts_are_skipped_not_fatal(daemon, tmp_path):
    data = tmp_path / "prompts.jsonl"
    long = {index for index in range(40) if index % 5 == 0}
    with open(data, "wb") as handle:
        for index in range(40):
            digit = str(index % 10)
            prompt = digit * 12 + "=" if index in long else digit + "="
            handle.write(orjson.dumps({"prompt": prompt, "label": digit}) + b"\n")
    workdir = tmp_path / "job"
    run_job(daemon, workdir, [
        "--set", f"data.path={data}",
        "--set", "rollout.max_prompt_len=4",
        "--set", f"rollout.num_rollouts={ROLLOUTS}",
        "--set", "rollout.prompts_per_rollout=8",
        "--set", "rollout.n_samples_per_prompt=4",
        "--set", "trainer.global_batch_size=32",
        "--set", "trainer.micro_batch_size=32",
    ])  # fmt: skip
    skipped = []
    for rollout_id in range(ROLLOUTS):
        folder = jobenv.rollout_dir(workdir, rollout_id)
        batch = load_file(str(folder / "batch.safetensors"))
        assert not long & set(batch["prompt_indices"].tolist())  # never generated
        assert len(set(batch["prompt_indices"].tolist())) == 8  # the rollout is full all the same
        skipped += [index for index, _ in orjson.loads((folder / "meta.json").read_bytes())["skipped_prompts"]]
    assert skipped and set(skipped) <= long
    assert sum(line["rollout/skipped_prompts"] for line in metrics(workdir)) == len(skipped)
    events = [e for e in job_events(workdir) if e["kind"] == "prompts_skipped"]
    assert sorted(index for e in events for index, _ in e["prompts"]) == sorted(skipped)
