"""Megatron GPT (local layer spec, Llama architecture) to ``LlamaForCausalLM``.

The only non-trivial mapping is attention: megatron fuses q, k and v into one
``linear_qkv`` weight grouped by key/value head, [group 0: its q heads, k, v;
group 1: ...]; HF keeps separate ``q_proj``, ``k_proj`` and ``v_proj``. The gated
MLP's ``linear_fc1`` is [gate; up] in the canonical state.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, PreTrainedTokenizerFast

from elastic_rl.config import ModelSpec


def hf_config(spec: ModelSpec, vocab_size: int, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.norm_epsilon,
        rope_theta=spec.rope_theta,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def _split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    head_dim = spec.hidden_size // spec.num_attention_heads
    groups = spec.num_query_groups
    q_per_group = spec.num_attention_heads // groups
    grouped = qkv.view(groups, q_per_group + 2, head_dim, spec.hidden_size)
    q = grouped[:, :q_per_group].reshape(-1, spec.hidden_size)
    k = grouped[:, q_per_group].reshape(-1, spec.hidden_size)
    v = grouped[:, q_per_group + 1].reshape(-1, spec.hidden_size)
    return q, k, v


def to_hf_state(state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    hf = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
        "lm_head.weight": state["output_layer.weight"],
    }
    for layer in range(spec.num_layers):
        src, dst = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        q, k, v = _split_qkv(state[src + "self_attention.linear_qkv.weight"], spec)
        gate, up = state[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        hf.update(
            {
                dst + "input_layernorm.weight": state[src + "input_layernorm.weight"],
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": state[src + "self_attention.linear_proj.weight"],
                dst + "post_attention_layernorm.weight": state[src + "pre_mlp_layernorm.weight"],
                dst + "mlp.gate_proj.weight": gate,
                dst + "mlp.up_proj.weight": up,
                dst + "mlp.down_proj.weight": state[src + "mlp.linear_fc2.weight"],
            }
        )
    return hf
