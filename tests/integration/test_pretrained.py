"""Pretrained checkpoints in megatron: SmolLM2-135M-Instruct and small random Llama, Qwen2, Qwen3,
Qwen3-MoE and Mixtral models that transformers builds here. Import then export is bitwise the
identity, and megatron's logits match transformers' at every tensor-parallel size the model allows,
and in two pipeline stages. The mixtures of experts are also imported from their stacked layout
(what transformers holds in memory), and export as the per-expert checkpoint of the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from elastic_rl.model.tokenizer import as_transformers, build_tokenizer
from tests.processes import SMOLLM2, run_module_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

# Megatron (split into TP ranks) and transformers add up the same float32 products in different orders,
# and the rounding grows with the model's scale: a logit may differ by 1e-4 plus 1e-5 of the largest
# logit (SmolLM2's reach about 20; its TP=3 logits were 1.4e-4 off with transformers 5.24).
LOGIT_ATOL, LOGIT_RTOL = 1e-4, 1e-5


def logit_tolerance(expected: torch.Tensor) -> float:
    return LOGIT_ATOL + LOGIT_RTOL * expected.abs().max().item()


SMALL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
RANDOM_MODELS = {
    # Untied, with llama3 rope scaling whose low frequencies matter within 24 positions.
    "llama-rope-scaled": LlamaConfig(
        **SMALL,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2-tied": Qwen2Config(**SMALL, tie_word_embeddings=True),
    # A head_dim that is not hidden / heads, as in the real Qwen3 models.
    "qwen3": Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False),
    # Mixtures of experts: each chosen expert keeps its share of the softmax over all of them (Qwen3-MoE's
    # norm_topk_prob off), or the chosen ones' scores are renormalised (Mixtral, and Qwen3-30B-A3B).
    "qwen3-moe": Qwen3MoeConfig(
        **SMALL, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False
    ),
    "mixtral": MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
}

# The same models as these, saved with their experts stacked: name -> the per-expert checkpoint's name.
STACKED = {"qwen3-moe-stacked": "qwen3-moe", "mixtral-stacked": "mixtral"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return make_checkpoints(tmp_path_factory.mktemp("random-models"))


def make_checkpoints(root: Path, smollm2: bool = True) -> dict[str, Path]:
    """SmolLM2 (unless not ``smollm2``) and the random models, saved under ``root``, by name."""
    found = {}
    if smollm2:
        assert (SMOLLM2 / "config.json").is_file(), f"{SMOLLM2} is missing: run `make models`"
        found["smollm2"] = SMOLLM2
    for name, config in RANDOM_MODELS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # Norm weights start at 1; random ones make a wrong mapping show in the logits.
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name:
                    param.uniform_(0.5, 1.5)
        model.save_pretrained(root / name)
        as_transformers(build_tokenizer()).save_pretrained(root / name)  # a checkpoint comes with one
        found[name] = root / name
        for stacked_name in [stacked for stacked, saved in STACKED.items() if saved == name]:
            folder = root / stacked_name
            model.config.save_pretrained(folder)
            as_transformers(build_tokenizer()).save_pretrained(folder)
            save_file(
                {key: value.contiguous() for key, value in model.state_dict().items()}, folder / "model.safetensors"
            )
            found[stacked_name] = folder
    return found


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory) -> dict[tuple[str, int, int], Path]:
    """(model, TP, PP) -> the worker's output: the exported checkpoint and megatron's logits.

    SmolLM2 has 3 key/value heads, so it splits at TP=3, not TP=2.
    """
    runs = {
        (1, 1): list(checkpoints),
        (2, 1): [*RANDOM_MODELS, *STACKED],
        (3, 1): ["smollm2"],
        (1, 2): list(RANDOM_MODELS),
    }
    outputs = {}
    for (tp, pp), names in runs.items():
        out = tmp_path_factory.mktemp(f"tp{tp}-pp{pp}")
        run_module_ranks("tests.integration.pretrained_worker", tp * pp, out, pp, *(checkpoints[n] for n in names))
        outputs.update({(name, tp, pp): out / checkpoints[name].name for name in names})
    return outputs


CASES = (
    [("smollm2", 1, 1), ("smollm2", 3, 1)]
    + [(name, tp, pp) for name in RANDOM_MODELS for tp, pp in ((1, 1), (2, 1), (1, 2))]
    + [(name, tp, 1) for name in STACKED for tp in (1, 2)]
)


@pytest.mark.parametrize("name, tp, pp", CASES)
def test_import_then_export_is_bitwise_the_identity(checkpoints, exported, name, tp, pp):
    original = load_file(str(checkpoints[STACKED.get(name, name)] / "model.safetensors"))
    back = load_file(str(exported[name, tp, pp] / "hf" / "model.safetensors"))
    assert sorted(back) == sorted(original)
    for tensor_name, tensor in original.items():
        assert torch.equal(back[tensor_name], tensor.float()), tensor_name


@pytest.mark.parametrize("name, tp, pp", CASES)
def test_megatron_logits_match_transformers(checkpoints, exported, name, tp, pp):
    saved = torch.load(exported[name, tp, pp] / "logits.pt", weights_only=True)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[STACKED.get(name, name)]), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(saved["tokens"]).logits
    assert saved["logits"].shape == expected.shape
    assert (saved["logits"] - expected).abs().max().item() <= logit_tolerance(expected)


def test_the_export_is_a_checkpoint_of_the_same_family(checkpoints, exported):
    for name, family in (("qwen3", "Qwen3"), ("qwen3-moe", "Qwen3Moe"), ("mixtral", "Mixtral")):
        hf = AutoModelForCausalLM.from_pretrained(str(exported[name, 2, 1] / "hf"), dtype=torch.float32)
        assert type(hf).__name__ == f"{family}ForCausalLM"
    folder = exported["smollm2", 3, 1] / "hf"
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= {p.name for p in folder.iterdir()}
