"""The memory accounting (policies.memory, elastic_rl.memory_plan, `erl plan`): parameters counted as the
layouts lay them out, bytes per parameter by precision, the micro-batch the estimate takes, and the check
against the slots' memory."""

from __future__ import annotations

import pytest

from elastic_rl.cli.main import main
from elastic_rl.memory_plan import plan
from elastic_rl.spec.loading import load_spec
from policies.memory import (
    FP32_SHARDED,
    FP32_WHOLE,
    GIB,
    HIDDEN_COPIES,
    LOGIT_COPIES,
    MEGATRON_BF16,
    MIB,
    SELECTIVE_HIDDEN_COPIES,
    ActivationLayout,
    Kept,
    Layout,
    ModelShape,
    activation_bytes,
    host_shortfall,
    layer_parameters,
    layers_per_stage,
    rank_memory,
    slot_shortfall,
    stage_parameters,
)
from tests.processes import SPEC

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# Llama 3 8B's config.json: 8,030,261,248 parameters, as its model card counts them.
LLAMA_8B = ModelShape(
    vocab_size=128256,
    hidden_size=4096,
    num_layers=32,
    num_attention_heads=32,
    num_query_groups=8,
    head_dim=128,
    ffn_hidden_size=14336,
)
SMALL = ModelShape(64, 16, 5, 4, 2, 4, 32)


def test_a_known_model_is_counted_to_the_parameter():
    assert sum(stage_parameters(LLAMA_8B, Layout())) == 8_030_261_248


def test_a_mixture_of_experts_is_counted_to_the_parameter():
    qwen3_30b_a3b = ModelShape(
        vocab_size=151_936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=768,
        qk_norm=True,
        experts=128,
        experts_per_token=8,
    )
    assert sum(stage_parameters(qwen3_30b_a3b, Layout())) == 30_532_122_624
    # Over 8 expert-parallel ranks each holds 16 of each layer's 128 experts, and everything else whole.
    experts = 48 * 128 * 3 * 768 * 2048
    split = sum(stage_parameters(qwen3_30b_a3b, Layout(data_parallel=8, expert_parallel=8)))
    assert split == 30_532_122_624 - experts + experts // 8


def test_tensor_parallel_ranks_split_the_matrices_and_each_keep_the_norms():
    whole, half = layer_parameters(SMALL, 1), layer_parameters(SMALL, 2)
    norms = 2 * SMALL.hidden_size
    assert half - norms == (whole - norms) // 2
    with_extras = ModelShape(64, 16, 5, 4, 2, 4, 32, qkv_bias=True, qk_norm=True)
    qkv_rows = (4 + 2 * 2) * 4
    assert layer_parameters(with_extras, 1) == whole + qkv_rows + 2 * 4


def test_pipeline_stages_split_the_layers_and_the_ends_hold_the_embeddings():
    assert layers_per_stage(30, 4) == [8, 8, 7, 7]
    embedding = SMALL.vocab_size * SMALL.hidden_size
    one = stage_parameters(SMALL, Layout())
    two = stage_parameters(SMALL, Layout(pipeline_parallel=2))
    assert sum(two) == sum(one)  # untied: each end holds its own matrix either way
    tied = ModelShape(64, 16, 5, 4, 2, 4, 32, tie_embeddings=True)
    # Tied, one stage holds the matrix once; split, the last stage holds its own copy of the first's.
    assert sum(stage_parameters(tied, Layout())) == sum(one) - embedding
    assert sum(stage_parameters(tied, Layout(pipeline_parallel=2))) == sum(one)


def test_bytes_per_parameter_and_the_sharded_optimizer():
    memory = rank_memory(LLAMA_8B, Layout(), FP32_WHOLE, tokens=1, sequence=1, frozen_models=1)
    assert memory.parameter_bytes == memory.gradient_bytes == memory.frozen_bytes == 4 * memory.parameters
    assert memory.optimizer_bytes == 8 * memory.parameters
    layout = Layout(tensor_parallel=2, pipeline_parallel=2, data_parallel=4)
    sharded = rank_memory(LLAMA_8B, layout, MEGATRON_BF16, tokens=1, sequence=1, frozen_models=0)
    assert sharded.parameters in stage_parameters(LLAMA_8B, layout)
    assert sharded.optimizer_bytes == 12 * sharded.parameters // 4
    assert sharded.frozen_bytes == 0


def test_activations_grow_with_the_tokens_and_only_unfused_attention_with_the_sequence():
    fused, unfused = ActivationLayout(), ActivationLayout(fused_attention=False)

    def activations(tokens: int, sequence: int, held: ActivationLayout) -> int:
        return rank_memory(SMALL, Layout(), FP32_WHOLE, tokens, sequence, False, held).activation_bytes

    assert activations(200, 100, fused) == 2 * activations(100, 100, fused)
    assert activations(100, 200, fused) == activations(100, 100, fused)  # nothing of [seq, seq]
    assert activations(100, 200, unfused) > activations(100, 100, unfused) > activations(100, 100, fused)


def test_recomputation_and_chunked_logits_hold_less():
    def activations(held: ActivationLayout) -> int:
        return rank_memory(SMALL, Layout(), FP32_WHOLE, 4096, 4096, False, held).activation_bytes

    kept = [activations(ActivationLayout(kept=kept)) for kept in (Kept.ALL, Kept.SELECTIVE, Kept.INPUTS)]
    assert kept[0] > kept[1] > kept[2]
    whole = activations(ActivationLayout())
    capped = activations(ActivationLayout(logits_cap_bytes=MIB))
    assert whole - capped == LOGIT_COPIES * (4096 * SMALL.vocab_size * 4 - MIB)


def test_sequence_parallelism_splits_the_hidden_sized_activations_over_the_tensor_ranks():
    tp2 = Layout(tensor_parallel=2)
    for kept in Kept:

        def activations(held: ActivationLayout) -> int:
            return rank_memory(LLAMA_8B, tp2, FP32_WHOLE, 4096, 4096, False, held).activation_bytes

        whole, split = (
            activations(ActivationLayout(kept=kept)),
            activations(ActivationLayout(kept=kept, sequence_parallel=True)),
        )
        hidden_copies = {Kept.ALL: HIDDEN_COPIES, Kept.SELECTIVE: SELECTIVE_HIDDEN_COPIES, Kept.INPUTS: 1}[kept]
        again = 0 if kept is Kept.ALL else HIDDEN_COPIES  # a recomputing layer's whole activations, once
        per_token = LLAMA_8B.num_layers * hidden_copies + again
        assert whole - split == 4096 * per_token * (LLAMA_8B.hidden_size // 2) * 4, kept


def test_the_first_pipeline_stage_holds_a_micro_batch_in_flight_per_stage():
    layout = Layout(pipeline_parallel=2)
    first = activation_bytes(SMALL, layout, FP32_WHOLE, 100, 100, stage=0)
    last = activation_bytes(SMALL, layout, FP32_WHOLE, 100, 100, stage=1)
    logits = 100 * 3 * SMALL.vocab_size * 4
    # Three layers twice over on the first stage, two layers once and the logits on the last.
    assert (first // 6) == (last - logits) // 2


def test_the_micro_batch_is_the_longest_samples_the_spec_allows():
    default = plan(load_spec(SPEC))  # 64 samples of the whole 64-token context
    assert (default.tokens, default.sequence) == (64 * 64, 64)
    bounded = plan(load_spec(SPEC, ["rollout.max_prompt_len=20", "rollout.max_new_tokens=12"]))
    assert (bounded.tokens, bounded.sequence) == (64 * 32, 32)
    budget = plan(load_spec(SPEC, ["trainer.max_tokens_per_micro_batch=48"]))
    assert budget.tokens == 64  # a sample longer than the budget goes alone
    assert plan(load_spec(SPEC, ["algorithm.kl_coef=0.1"])).memory.frozen_bytes > 0


def test_a_slot_too_small_everywhere_is_a_shortfall_and_an_unknown_one_is_not():
    assert slot_shortfall(2 * GIB, {}) is None  # no node of the kind yet: the job waits
    assert slot_shortfall(2 * GIB, {"a": GIB, "b": None}) is None  # b might hold it
    assert slot_shortfall(2 * GIB, {"a": GIB, "b": 3 * GIB}) is None
    message = slot_shortfall(2 * GIB, {"a": GIB, "b": GIB // 2})
    assert message is not None and "a 1.0 GiB" in message and "b 0.5 GiB" in message


def test_erl_plan_prints_the_rank_of_the_spec(capsys):
    assert main(["plan", str(SPEC), "--set", "trainer.tensor_parallel=2"]) == 0
    out = capsys.readouterr().out
    assert "TP=2" in out and "41,280" in out  # what each rank of a TP=2 replica builds (test_memory_accounting)


def test_bf16_parameters_count_megatrons_buffers_and_shard_the_main_weights():
    whole = plan(load_spec(SPEC, ["trainer.dtype=bf16-params"])).memory
    assert whole.parameter_bytes == 2 * whole.parameters  # bf16
    assert whole.gradient_bytes == 4 * whole.parameters  # megatron's fp32 gradient buffers
    assert whole.optimizer_bytes == 12 * whole.parameters  # fp32 main weights and two moments
    sharded = plan(load_spec(SPEC, ["trainer.dtype=bf16-params", "trainer.data_parallel=4"])).memory
    assert sharded.optimizer_bytes == 12 * sharded.parameters // 4
    fp32 = plan(load_spec(SPEC, ["trainer.data_parallel=4"])).memory
    assert sharded.parameter_bytes + sharded.gradient_bytes + sharded.optimizer_bytes < (
        fp32.parameter_bytes + fp32.gradient_bytes + fp32.optimizer_bytes
    )


def test_an_offloaded_optimizer_is_counted_in_host_memory_with_its_copy_buffers(capsys):
    kept = rank_memory(LLAMA_8B, Layout(data_parallel=4), FP32_SHARDED, tokens=1, sequence=1, frozen_models=0)
    offloaded = rank_memory(
        LLAMA_8B, Layout(data_parallel=4), FP32_SHARDED, tokens=1, sequence=1, frozen_models=0, optimizer_offload=True
    )
    assert offloaded.optimizer_bytes == 0 and kept.host_bytes == 0
    assert offloaded.total == kept.total - kept.optimizer_bytes  # 8 bytes a parameter left on the device
    # The moments (8 bytes a parameter, a quarter of them per rank) and two fp32 buffers of the largest
    # tensor, the 128,256 x 4,096 embedding.
    assert offloaded.host_bytes == 8 * offloaded.parameters // 4 + 2 * 128256 * 4096 * 4
    assert main(["plan", str(SPEC), "--set", "trainer.optimizer_offload=true"]) == 0
    assert "host memory" in capsys.readouterr().out


def test_a_critic_is_one_more_trained_copy_of_the_model(capsys):
    policy = rank_memory(LLAMA_8B, Layout(), FP32_WHOLE, tokens=1, sequence=1, frozen_models=0)
    ppo = rank_memory(LLAMA_8B, Layout(), FP32_WHOLE, tokens=1, sequence=1, frozen_models=0, critic=True)
    # fp32 weights and gradients, AdamW's two moments: 16 bytes a parameter more; no more activations.
    assert ppo.critic_bytes == 16 * ppo.parameters and ppo.total == policy.total + ppo.critic_bytes
    offloaded = rank_memory(
        LLAMA_8B, Layout(), FP32_WHOLE, tokens=1, sequence=1, frozen_models=0, critic=True, optimizer_offload=True
    )
    assert offloaded.critic_bytes == 8 * ppo.parameters
    assert offloaded.host_bytes == 16 * ppo.parameters + 2 * 128256 * 4096 * 4  # both models' moments
    assert plan(load_spec(SPEC, ["algorithm.advantage_estimator=ppo"])).memory.critic_bytes > 0
    assert main(["plan", str(SPEC), "--set", "algorithm.advantage_estimator=ppo"]) == 0
    assert "critic" in capsys.readouterr().out


def test_a_host_too_small_per_slot_everywhere_is_a_shortfall():
    assert host_shortfall(GIB, {}) is None
    assert host_shortfall(GIB, {"a": (4 * GIB, 8), "b": (None, 8)}) is None  # b's is not known
    assert host_shortfall(GIB, {"a": (4 * GIB, 8), "b": (16 * GIB, 8)}) is None  # b has 2 GiB a slot
    message = host_shortfall(GIB, {"a": (4 * GIB, 8)})
    assert message is not None and "a 4.0 GiB over 8 slots" in message


def test_context_parallel_ranks_split_the_tokens_and_keep_the_keys_they_gather():
    whole = rank_memory(LLAMA_8B, Layout(), FP32_WHOLE, tokens=8192, sequence=8192, frozen_models=0)
    layout = Layout(context_parallel=2)
    split = rank_memory(LLAMA_8B, layout, FP32_WHOLE, tokens=8192, sequence=8192, frozen_models=0)
    assert layout.ranks == 2 and str(layout) == "TP=1 CP=2 PP=1 DP=1"
    assert split.parameter_bytes == whole.parameter_bytes  # every rank holds the whole model
    # Half the tokens, each layer also keeping 2.5 times its tokens' keys and values (8 groups of 128).
    half = rank_memory(LLAMA_8B, Layout(), FP32_WHOLE, tokens=4096, sequence=4096, frozen_models=0)
    gathered = 4096 * 32 * (2 * 8 * 128 * 5 // 2) * 4
    assert split.activation_bytes == half.activation_bytes + gathered
