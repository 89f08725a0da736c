"""A job's memory per trainer rank, from its spec: the model's shape, the replica's layout, the micro-batch.

The accounting itself is ``policies.memory`` (pure); this reads what it needs from the spec (the
architecture from config.json, the toy model's vocabulary from its tokenizer) and sizes the micro-batch
the way the trainer cuts them: ``trainer.max_tokens_per_micro_batch`` token slots (a longer sample
goes alone), or ``trainer.micro_batch_size`` samples of the longest length a sample can have: the
longest prompt (``rollout.max_prompt_len``) and response (``rollout.max_new_tokens``), or without a
longest prompt the model's whole context. The estimate is only as tight as that bound.
`erl plan` prints it; `erl submit` checks it against the slots' memory (``elastic_rl.jobs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_rl.architecture import Architecture, from_hf_config
from elastic_rl.spec.job import JobSpec
from elastic_rl.spec.trainer import Attention, TrainerSpec
from policies import devices
from policies.memory import (
    FP32_SHARDED,
    FP32_WHOLE,
    LOGITS_BUDGET_BYTES,
    MEGATRON_BF16,
    ActivationLayout,
    Kept,
    Layout,
    ModelShape,
    Precision,
    RankMemory,
    rank_memory,
)


@dataclass(frozen=True)
class MemoryPlan:
    """One trainer rank's memory, with the layout and micro-batch it was accounted for."""

    layout: Layout
    memory: RankMemory
    tokens: int
    """Token slots in the largest micro-batch."""
    sequence: int
    """The longest sample, in tokens."""


def model_shape(architecture: Architecture) -> ModelShape:
    experts = architecture.experts
    return ModelShape(
        vocab_size=architecture.vocab_size,
        hidden_size=architecture.hidden_size,
        num_layers=architecture.num_layers,
        num_attention_heads=architecture.num_attention_heads,
        num_query_groups=architecture.num_query_groups,
        head_dim=architecture.head_dim,
        ffn_hidden_size=experts.ffn_hidden_size if experts else architecture.ffn_hidden_size,
        tie_embeddings=architecture.tie_embeddings,
        qkv_bias=architecture.qkv_bias,
        qk_norm=architecture.qk_norm,
        experts=experts.count if experts else 0,
        experts_per_token=experts.per_token if experts else 0,
    )


def spec_architecture(spec: JobSpec) -> Architecture:
    if spec.model.hf_checkpoint is not None:
        return from_hf_config(spec.model.hf_checkpoint)
    # The toy vocabulary is its tokenizer's, padded, counted as the trainer counts it (through transformers).
    from elastic_rl.model.tokenizer import load_tokenizer, padded_vocab_size

    return spec.model.toy_architecture(padded_vocab_size(load_tokenizer(spec.model)))


def precision_of(spec: JobSpec) -> Precision:
    if spec.trainer.dtype is devices.Precision.BF16_PARAMS:
        return MEGATRON_BF16
    return FP32_SHARDED if spec.trainer.data_parallel > 1 and spec.trainer.shard_optimizer else FP32_WHOLE


def longest_sample(spec: JobSpec) -> int:
    """The most tokens one sample can have, prompt and response."""
    context = spec.model.context_length
    if spec.rollout.max_prompt_len is None:
        return context
    return min(context, spec.rollout.max_prompt_len + spec.rollout.max_new_tokens)


def activation_layout(trainer: TrainerSpec) -> ActivationLayout:
    """How the trainer holds its activations: its attention, its recomputation, its chunked logits, its
    sequence parallelism."""
    return ActivationLayout(
        fused_attention=trainer.attention is Attention.SDPA,
        kept=Kept(trainer.recompute.value),
        logits_cap_bytes=LOGITS_BUDGET_BYTES,
        sequence_parallel=trainer.sequence_parallel,
    )


def plan(spec: JobSpec) -> MemoryPlan:
    """The fullest trainer rank of the spec's replica layout."""
    trainer = spec.trainer
    sequence = longest_sample(spec)
    budget = trainer.max_tokens_per_micro_batch
    tokens = max(budget, sequence) if budget is not None else trainer.micro_batch_size * sequence
    layout = Layout(
        trainer.tensor_parallel,
        trainer.pipeline_parallel,
        trainer.data_parallel,
        trainer.expert_parallel,
        trainer.context_parallel,
    )
    memory = rank_memory(
        model_shape(spec_architecture(spec)),
        layout,
        precision_of(spec),
        tokens=tokens,
        sequence=sequence,
        frozen_models=spec.algorithm.frozen_models,
        held=activation_layout(trainer),
        optimizer_offload=trainer.optimizer_offload,
        critic=spec.algorithm.critic is not None,
    )
    return MemoryPlan(layout, memory, tokens, sequence)
