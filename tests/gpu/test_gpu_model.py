"""Megatron on GPUs: each tensor-parallel rank on its own GPU over NCCL, as erld places them. Its logits
match transformers' at TP=1 and TP=2, and import then export is still bitwise the identity."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.gpu.conftest import require_gpus
from tests.integration.test_pretrained import RANDOM_MODELS, logit_tolerance, make_checkpoints
from tests.processes import SMOLLM2, run_module_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    # A GPU machine that has not run `make models` checks the random models only.
    return make_checkpoints(tmp_path_factory.mktemp("random-models"), smollm2=(SMOLLM2 / "config.json").is_file())


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_logits_match_transformers_on_gpus(checkpoints, tmp_path, tp):
    require_gpus(tp)
    # SmolLM2's 3 kv heads do not split in 2.
    names = list(RANDOM_MODELS) + (["smollm2"] if tp == 1 and "smollm2" in checkpoints else [])
    run_module_ranks("tests.integration.pretrained_worker", tp, tmp_path, *(checkpoints[n] for n in names), gpus=True)
    for name in names:
        out = tmp_path / checkpoints[name].name
        saved = torch.load(out / "logits.pt", weights_only=True)
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[name]), dtype=torch.float32).cuda().eval()
        with torch.no_grad():
            expected = hf(saved["tokens"].cuda()).logits.cpu()
        assert saved["logits"].shape == expected.shape, name
        assert (saved["logits"] - expected).abs().max().item() <= logit_tolerance(expected), name
        original = load_file(str(checkpoints[name] / "model.safetensors"))
        back = load_file(str(out / "hf" / "model.safetensors"))
        assert all(torch.equal(back[key], tensor.float()) for key, tensor in original.items()), name
