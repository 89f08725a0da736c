"""Eval: held-out prompts generated with their own seeds, scored, and reported as eval/<name>/...;
an eval sample the reward cannot score is counted, an over-long prompt skipped. Generation is the
fake router of the dynamic-sampling tests."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from elastic_rl.errors import SpecError
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.rollout.evaluation import Evaluator
from elastic_rl.rollout.generation import GroupGenerator
from elastic_rl.rollout.scoring import Scorer
from elastic_rl.spec.loading import validate_spec
from tests.unit.test_dynamic_sampling import FakeRouter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def job(tmp_path, interval: int = 2, **dataset):
    path = tmp_path / "held-out.jsonl"
    rows = [{"prompt": f"{d}=", "label": str(d)} for d in range(10)] + [{"prompt": "1" * 80 + "=", "label": "1"}]
    path.write_bytes(b"\n".join(orjson.dumps(row) for row in rows))
    return validate_spec(
        {
            "name": "t",
            "rollout": {"prompts_per_rollout": 4, "n_samples_per_prompt": 4, "max_new_tokens": 1, "max_prompt_len": 8},
            "trainer": {"global_batch_size": 16, "micro_batch_size": 16},
            "eval": {"interval_rollouts": interval, "datasets": [{"name": "digits", "path": str(path), **dataset}]},
        }
    )


def test_eval_runs_at_its_interval_and_reports_each_dataset(tmp_path):
    spec = job(tmp_path, n_samples_per_prompt=3, sampling={"temperature": 1.0})
    tokenizer = load_tokenizer(spec.model)
    router = FakeRouter(tokenizer)
    evaluator = Evaluator(spec, tokenizer, GroupGenerator(spec, router, tokenizer), Scorer(spec.rollout, tokenizer))
    assert [evaluator.due(r) for r in range(5)] == [True, False, True, False, True]
    metrics = asyncio.run(evaluator.run(0))
    assert metrics["eval/digits/samples"] == 30 and metrics["eval/digits/skipped_prompts"] == 1
    assert 0.0 <= metrics["eval/digits/reward_mean"] <= 1.0 and metrics["eval/digits/unscorable_samples"] == 0
    assert asyncio.run(evaluator.run(0))["eval/digits/reward_mean"] == metrics["eval/digits/reward_mean"]  # seeded

    def raises_on_sevens(prompt, response, label):
        if label == "7":
            raise ValueError("no rule for sevens")
        return float(response == label)

    evaluator.scorer.rule = raises_on_sevens
    assert asyncio.run(evaluator.run(2))["eval/digits/unscorable_samples"] == 3


def test_bad_eval_settings_are_named(tmp_path):
    with pytest.raises(SpecError, match="eval: interval_rollouts is set but datasets is empty"):
        validate_spec({"name": "t", "eval": {"interval_rollouts": 5}})
    with pytest.raises(SpecError, match=r"eval.datasets.0.path: file not found"):
        validate_spec(
            {
                "name": "t",
                "eval": {"interval_rollouts": 5, "datasets": [{"name": "x", "path": str(tmp_path / "no.jsonl")}]},
            }
        )
    spec = job(tmp_path).model_dump()
    spec["eval"]["datasets"] *= 2
    with pytest.raises(SpecError, match="repeated: digits"):
        validate_spec(spec)
