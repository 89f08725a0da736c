"""Builds the policy as a megatron-core ``GPTModel`` with the Llama architecture.

RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, no biases, untied
embeddings: the architecture the ``llama`` converter exports to
``LlamaForCausalLM``. Weights are initialised on the CPU from the full (unsharded)
tensors, so a given seed gives the same model at every tensor-parallel size.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from elastic_rl.config import ModelSpec
from elastic_rl.model.cpu_shim import apply_cpu_shim


def transformer_config(spec: ModelSpec, tensor_parallel: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        kv_channels=spec.hidden_size // spec.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_method_std,
        tensor_model_parallel_size=tensor_parallel,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def build_gpt(spec: ModelSpec, vocab_size: int, tensor_parallel: int = 1) -> GPTModel:
    """The policy model on this rank. Model parallelism must be initialised first.

    Its logits stay sharded over the vocabulary (see ``vocab_parallel``).
    """
    if vocab_size % tensor_parallel:
        raise ValueError(f"vocab size {vocab_size} is not divisible by tensor_parallel {tensor_parallel}")
    return GPTModel(
        config=transformer_config(spec, tensor_parallel),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
    )


def init_model_parallel(
    tensor_parallel: int, seed: int, init_method: str | None = None, timeout_s: float = 300.0
) -> None:
    """Join the process group and set up megatron's groups.

    With no ``init_method`` the group comes from torchrun-style environment
    variables; a ``tcp://`` init method makes a single-process group. On a
    CPU-only machine the backend is gloo and the CPU shim is applied.
    """
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        single = {"world_size": 1, "rank": 0} if init_method else {}
        torch.distributed.init_process_group(
            backend=backend, init_method=init_method, timeout=timedelta(seconds=timeout_s), **single
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    apply_cpu_shim(seed)
    torch.manual_seed(seed)


def destroy_model_parallel() -> None:
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def forward_gpt(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's logits ``[batch, seq, vocab/tp]``.

    The causal mask is passed explicitly (True = hidden) because megatron's default
    mask is built on the GPU. Sequences are right-padded, so a causal mask alone
    keeps padding out of every real token's attention.
    """
    seq = tokens.shape[1]
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(diagonal=1)
    return model(tokens, positions, attention_mask=mask[None, None])
