"""A mixture-of-experts policy in a real job: a small random Qwen3-MoE with the toy tokenizer trains on
the toy task through the cpu engines (which serve it with transformers), replaying the engines' routing
and reporting each layer's expert load; an engine and a trainer killed (under `make chaos`) change
nothing, the committed routing replayed. Under `make chaos` too, the
experts split over two data-parallel ranks (expert parallelism) import, export and train as whole ones."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from elastic_rl.model.tokenizer import as_transformers, build_tokenizer
from tests.integration.erld_support import metrics, run_job
from tests.integration.test_pretrained import logit_tolerance
from tests.integration.test_replicas import final_weights
from tests.processes import SPEC, run_module_ranks

pytestmark = [pytest.mark.integration]

EXPERTS, PER_TOKEN = 4, 2


def moe_checkpoint(folder: Path, config_class=Qwen3MoeConfig, **family) -> Path:
    """A random mixture of experts (two layers of four experts, two per token) with the toy tokenizer."""
    tokenizer = as_transformers(build_tokenizer())
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=PER_TOKEN,
        **family,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_spec(tmp_path_factory) -> Path:
    """The tiny job's spec with a random Qwen3-MoE as its policy."""
    root = tmp_path_factory.mktemp("moe")
    qwen3_moe = {"head_dim": 16, "num_experts": EXPERTS, "moe_intermediate_size": 64, "norm_topk_prob": True}
    checkpoint = moe_checkpoint(root / "qwen3-moe", **qwen3_moe)
    spec = yaml.safe_load(SPEC.read_text())
    spec["model"] = {"hf_checkpoint": str(checkpoint)}
    (root / "moe.yaml").write_text(yaml.safe_dump(spec))
    return root / "moe.yaml"


def job(rollouts: int) -> list[str]:
    settings = [f"rollout.num_rollouts={rollouts}", "trainer.moe_aux_loss_coef=0.01", "algorithm.routing_replay=true"]
    return [arg for setting in settings for arg in ("--set", setting)]


@pytest.mark.timeout(400)
def test_a_mixture_of_experts_trains_replaying_its_routing_and_reports_its_expert_load(daemon, tmp_path, moe_spec):
    run_job(daemon, tmp_path, job(6), spec=moe_spec, timeout_s=360)
    lines = metrics(tmp_path)
    assert [line["rollout"] for line in lines] == list(range(6))
    for line in lines:
        assert math.isfinite(line["rollout/reward_mean"]) and math.isfinite(line["train/loss"]), line
        # The routing each token had in the engine reached the trainer, and its log probs are the engine's.
        assert 0.9 <= line["train/routing_agreement"] <= 1.0, line
        assert line["train/on_policy_logprob_abs_diff_max"] <= 1e-5, line
        # The busiest expert's tokens over the mean: 1 when even, at most experts / per_token (every token
        # sends one of its picks to the same expert).
        for layer in range(2):
            load = line[f"train/expert_load_max_over_mean/layer_{layer}"]
            assert 1.0 <= load <= EXPERTS / PER_TOKEN, line
        assert line["train/expert_load_max_over_mean"] == max(
            line[f"train/expert_load_max_over_mean/layer_{i}"] for i in range(2)
        )


# Each layer's experts split over the replica's two data-parallel ranks.
EXPERT_PARALLEL = ["trainer.data_parallel=2", "trainer.expert_parallel=2", "trainer.shard_optimizer=false"]


@pytest.mark.chaos
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [[], EXPERT_PARALLEL], ids=["whole-experts", "expert-parallel"])
def test_a_mixture_of_experts_job_loses_nothing_to_an_engine_and_a_trainer_kill(daemon, tmp_path, moe_spec, layout):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    settings = job(12) + [arg for setting in layout for arg in ("--set", setting)]
    run_job(daemon, clean, settings, spec=moe_spec, timeout_s=500)
    killed = run_job(daemon, faulty, settings, [("engine-0", 3), ("trainer-0-0", 7)], spec=moe_spec, timeout_s=500)
    assert killed == ["engine-0", "trainer-0-0"]
    # The engine's in-flight generations are continued with their prefixes' routing, and the trainer
    # replays the committed rollouts with theirs: the same weights, bit for bit.
    expected, recovered = final_weights(clean, 12), final_weights(faulty, 12)
    assert expected.keys() == recovered.keys()
    assert all(torch.equal(expected[name], recovered[name]) for name in expected)
    assert [line["rollout"] for line in metrics(faulty)] == list(range(12))


@pytest.mark.chaos
@pytest.mark.timeout(300)
def test_experts_split_over_two_ranks_import_export_and_train_as_whole_ones(tmp_path, moe_spec):
    policy = Path(yaml.safe_load(moe_spec.read_text())["model"]["hf_checkpoint"])
    mixtral = moe_checkpoint(tmp_path / "mixtral", MixtralConfig, num_local_experts=EXPERTS)
    out = tmp_path / "out"
    run_module_ranks("tests.integration.expert_parallel_worker", 2, out, moe_spec, policy, mixtral)
    for checkpoint in (policy, mixtral):
        original = load_file(str(checkpoint / "model.safetensors"))
        back = load_file(str(out / checkpoint.name / "hf" / "model.safetensors"))
        assert sorted(back) == sorted(original)
        for name, tensor in original.items():
            assert torch.equal(back[name], tensor.float()), name
        saved = torch.load(out / checkpoint.name / "logits.pt", weights_only=True)
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        with torch.no_grad():
            expected = hf(saved["tokens"]).logits
        assert (saved["logits"] - expected).abs().max().item() <= logit_tolerance(expected)
    result = orjson.loads((out / "result.json").read_bytes())
    assert result["local_experts"] == EXPERTS // 2, result
    # The same sums in another order: each expert's tokens arrive from two ranks in one product.
    rank0, rank1 = result["micro_batches_per_step"]
    assert rank0 != rank1, result  # so a rank ran empty micro-batches to match the other's
    assert result["first_gradients_ep2_vs_ep1"] <= 1e-5, result
    assert result["weights_ep2_vs_ep1_in_lr"] <= 1e-2, result  # AdamW's first step magnifies the order
    assert result["loaded_vs_saved"] == 0.0, result
    assert result["resumed_step_vs_ep2"] <= 1e-5, result
