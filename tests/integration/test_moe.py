"""A mixture-of-experts policy in a real job: a small random Qwen3-MoE with the toy tokenizer trains on
the toy task through the cpu engines (which serve it with transformers), reporting each layer's expert
load; an engine and a trainer killed (under `make chaos`) change nothing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from elastic_rl.model.tokenizer import as_transformers, build_tokenizer
from tests.integration.erld_support import metrics, run_job
from tests.integration.test_replicas import assert_close_relative, final_weights
from tests.processes import SPEC

pytestmark = [pytest.mark.integration]

EXPERTS, PER_TOKEN = 4, 2


@pytest.fixture(scope="module")
def moe_spec(tmp_path_factory) -> Path:
    """The tiny job's spec with a random Qwen3-MoE (two layers of four experts, two per token) as its policy."""
    root = tmp_path_factory.mktemp("moe")
    checkpoint = root / "qwen3-moe"
    tokenizer = as_transformers(build_tokenizer())
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        num_experts=EXPERTS,
        num_experts_per_tok=PER_TOKEN,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    spec = yaml.safe_load(SPEC.read_text())
    spec["model"] = {"hf_checkpoint": str(checkpoint)}
    (root / "moe.yaml").write_text(yaml.safe_dump(spec))
    return root / "moe.yaml"


def job(rollouts: int) -> list[str]:
    return ["--set", f"rollout.num_rollouts={rollouts}", "--set", "trainer.moe_aux_loss_coef=0.01"]


@pytest.mark.timeout(400)
def test_a_mixture_of_experts_trains_and_reports_its_expert_load(daemon, tmp_path, moe_spec):
    run_job(daemon, tmp_path, job(6), spec=moe_spec, timeout_s=360)
    lines = metrics(tmp_path)
    assert [line["rollout"] for line in lines] == list(range(6))
    for line in lines:
        assert math.isfinite(line["rollout/reward_mean"]) and math.isfinite(line["train/loss"]), line
        # The busiest expert's tokens over the mean: 1 when even, at most experts / per_token (every token
        # sends one of its picks to the same expert).
        for layer in range(2):
            load = line[f"train/expert_load_max_over_mean/layer_{layer}"]
            assert 1.0 <= load <= EXPERTS / PER_TOKEN, line
        assert line["train/expert_load_max_over_mean"] == max(
            line[f"train/expert_load_max_over_mean/layer_{i}"] for i in range(2)
        )


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_a_mixture_of_experts_job_loses_nothing_to_an_engine_and_a_trainer_kill(daemon, tmp_path, moe_spec):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_job(daemon, clean, job(12), spec=moe_spec, timeout_s=500)
    killed = run_job(daemon, faulty, job(12), [("engine-0", 3), ("trainer-0-0", 7)], spec=moe_spec, timeout_s=500)
    assert killed == ["engine-0", "trainer-0-0"]
    assert_close_relative(final_weights(clean, 12), final_weights(faulty, 12), 1e-5)
    assert [line["rollout"] for line in metrics(faulty)] == list(range(12))
