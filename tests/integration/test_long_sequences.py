"""The trainer's long-sequence paths on a real megatron model, in fp32 on CPU: torch's fused attention gives
megatron's local attention's logits and gradients; packed micro-batches give padded ones' log probs, loss
and gradients (at TP=1 with a mixture of experts too, at TP=2 and in two pipeline stages); log probs and
entropy scored in chunks give the whole logits' values and gradients, at TP=2 the TP=1 ones; activation
recomputation changes no gradient."""

from __future__ import annotations

import orjson
import pytest
import torch

from tests.integration.test_moe import moe_spec  # noqa: F401 (a fixture: a small mixture of experts' job spec)
from tests.processes import run_module_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# fp32: the fused kernel and the packed layout sum in other orders than their references.
VALUES, RELATIVE = 1e-5, 1e-5
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


@pytest.fixture(scope="module")
def results(tmp_path_factory, moe_spec) -> dict[str, dict]:  # noqa: F811
    """Each layout's figures; TP=1 with the mixture of experts as well."""
    found = {}
    for name, (tp, pp) in LAYOUTS.items():
        out = tmp_path_factory.mktemp(name)
        run_module_ranks(
            "tests.integration.long_sequence_worker", tp * pp, out, tp, pp, *([moe_spec] if tp == pp == 1 else [])
        )
        found[name] = orjson.loads((out / "result.json").read_bytes())
    return found


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_fused_attention_gives_local_attentions_logits_and_gradients(results, layout):
    figures = results[layout]["attention_and_chunks"]
    assert figures["attention_logits"] <= VALUES and figures["attention_grads"] <= RELATIVE, figures


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_log_probs_in_chunks_give_the_whole_logits_values_and_gradients(results, layout):
    figures = results[layout]["attention_and_chunks"]
    assert figures["chunks_values"] <= VALUES and figures["chunks_grads"] <= RELATIVE, figures


def test_the_entropys_gradient_is_the_same_at_tp2(results):
    one, two = (torch.tensor(results[name]["attention_and_chunks"]["final_norm_grad"]) for name in ("tp1", "tp2"))
    assert ((one - two).abs().max() / one.abs().max()).item() <= RELATIVE


@pytest.mark.parametrize("case", ["tp1/packing", "tp1/packing_moe", "tp2/packing", "pp2/packing"])
def test_packed_micro_batches_give_the_padded_ones_step(results, case):
    layout, name = case.split("/")
    assert_same_step(results[layout][name])


@pytest.mark.parametrize("case", [f"{layout}/recompute_{kind}" for layout in LAYOUTS for kind in ("selective", "full")])
def test_recomputation_changes_no_gradient(results, case):
    layout, name = case.split("/")
    assert_same_step(results[layout][name])


def assert_same_step(figures: dict[str, float]) -> None:
    assert figures["old_logp"] <= VALUES, figures
    assert figures["loss"] <= RELATIVE, figures
    assert figures["grads"] <= RELATIVE, figures
