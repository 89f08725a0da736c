"""Bad data inside a run: prompts longer than rollout.max_prompt_len, and samples the reward cannot
score, are skipped, recorded and counted, and the job goes on; past the budget it fails, saying why.
The same job generates through the multi-turn calculator example (examples/calculator_tool.py) and
scores with an async reward function that returns a dict: only the model's tokens are trained. Eval
on held-out prompts runs at its interval beside it, and never enters training."""

from __future__ import annotations

import orjson
import pytest
from safetensors.torch import load_file

from chaos.invariants import read_spec
from checkpoints import layout
from elastic_rl.model.tokenizer import load_tokenizer
from tests.integration.erld_support import job_events, metrics, run_job, status

pytestmark = [pytest.mark.integration]

ROLLOUTS = 3


@pytest.mark.timeout(300)
def test_over_long_prompts_and_unscorable_samples_are_skipped_not_fatal(daemon, tmp_path):
    data = tmp_path / "prompts.jsonl"
    long = {index for index in range(40) if index % 5 == 0}
    with open(data, "wb") as handle:
        for index in range(40):
            digit = str(index % 10)
            prompt = digit * 12 + "=" if index in long else digit + "="
            handle.write(orjson.dumps({"prompt": prompt, "label": digit}) + b"\n")
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_bytes(b"\n".join(orjson.dumps({"prompt": f"{d}=", "label": str(d)}) for d in range(10)))
    workdir = tmp_path / "job"
    run_job(
        daemon,
        workdir,
        [
            "--set",
            f"data.path={data}",
            "--set",
            "rollout.max_prompt_len=4",
            "--set",
            f"rollout.num_rollouts={ROLLOUTS}",
            "--set",
            "rollout.prompts_per_rollout=8",
            "--set",
            "rollout.n_samples_per_prompt=4",
            "--set",
            "trainer.global_batch_size=32",
            "--set",
            "trainer.micro_batch_size=32",
            "--set",
            "rollout.max_new_tokens=24",
            "--set",
            "rollout.generate_function=examples.calculator_tool:generate",
            "--set",
            "rollout.reward_function=tests.rewards:copied_by_key_raising_on_sevens",
            "--set",
            "rollout.reward_key=copied",
            "--set",
            "eval.interval_rollouts=2",
            "--set",
            f"eval.datasets=[{{name: held-out, path: {held_out}, n_samples_per_prompt: 2}}]",
        ],
    )
    tokenizer = load_tokenizer(read_spec(workdir).model)
    skipped, unscorable, tool_calls = [], [], 0
    for rollout_id in range(ROLLOUTS):
        folder = layout.rollout_dir(workdir, rollout_id)
        batch = load_file(str(folder / "batch.safetensors"))
        trained = set(batch["prompt_indices"].tolist())
        assert not long & trained  # never generated
        assert not {7, 17, 27, 37} & trained  # generated, but not trained without a reward
        assert len(trained) == 8  # the rollout is full all the same
        meta = orjson.loads((folder / "meta.json").read_bytes())
        tool_calls += assert_only_the_models_tokens_are_trained(batch, meta, tokenizer)
        skipped += [index for index, _ in meta["skipped_prompts"]]
        unscorable += [index for index, _, reason in meta["dropped_groups"] if reason == "unscorable"]
    assert tool_calls > 0
    assert skipped and set(skipped) <= long
    assert unscorable and set(unscorable) <= {7, 17, 27, 37}
    lines = metrics(workdir)
    assert sum(line["rollout/skipped_prompts"] for line in lines) == len(skipped)
    assert sum(line["rollout/unscorable_samples"] for line in lines) == 4 * len(unscorable)
    # Eval before rollouts 0 and 2: ten prompts, two samples each; "7=" cannot be scored.
    evaluated = [line["rollout"] for line in lines if "eval/held-out/samples" in line]
    assert evaluated == [0, 2]
    for line in (lines[0], lines[2]):
        assert line["eval/held-out/samples"] == 20 and line["eval/held-out/unscorable_samples"] == 2
        assert 0.0 <= line["eval/held-out/reward_mean"] <= 1.0
    events = job_events(workdir)
    assert sorted(index for e in events if e["kind"] == "prompts_skipped" for index, _ in e["prompts"]) == sorted(
        skipped
    )
    assert sorted(index for e in events if e["kind"] == "samples_skipped" for index, _ in e["prompts"]) == sorted(
        unscorable
    )


def assert_only_the_models_tokens_are_trained(batch: dict, meta: dict, tokenizer) -> int:
    """Each sample: the calculator's answer where its metadata says, masked out of the loss, no engine
    log prob there; the rest of the response masked in; the reward is the reward function's. Returns
    how many samples called the tool (one that ended its first turn itself did not)."""
    calls = 0
    for row, record in enumerate(meta["samples"]):
        start = int(batch["prompt_lengths"][row])
        end = start + int(batch["response_lengths"][row])
        tool = set()
        for call in record["metadata"]["tool_calls"]:
            tool |= set(range(start + call["start"], start + call["end"]))
            answer = tokenizer.decode(batch["tokens"][row, start + call["start"] : start + call["end"]].tolist())
            assert answer == call["answer"]
        calls += bool(tool)
        assert record["status"] in ("completed", "truncated")
        mask = batch["loss_mask"][row].tolist()
        assert mask == [1.0 if start <= t < end and t not in tool else 0.0 for t in range(len(mask))]
        assert all(batch["engine_logprobs"][row, t] == 0.0 for t in tool)
        response = tokenizer.decode(batch["tokens"][row, start:end].tolist(), skip_special_tokens=True)
        label = str(int(batch["prompt_indices"][row]) % 10)
        assert batch["rewards"][row] == float(response.startswith(label))
    return calls


@pytest.mark.timeout(200)
def test_unscorable_data_past_its_budget_fails_the_job_with_the_reason(daemon, tmp_path):
    run_job(
        daemon,
        tmp_path,
        [
            "--set",
            "rollout.reward=tests.rewards:always_raises",
            "--set",
            "rollout.max_consecutive_bad_samples=20",
        ],
        expect=("failed",),
    )
    reason = status(daemon, "tiny-grpo")["status"]["reason"]
    assert "orchestrator gave up: 20 samples in a row could not be scored" in reason, reason
    assert "RuntimeError: the reward service is down" in reason
    assert [e["kind"] for e in job_events(tmp_path)].count("proc_restarted") == 0  # no restart could help
