"""Where each weight lives in megatron's canonical state and in a Hugging Face checkpoint.

Megatron's canonical state is what a TP=1 model holds (``megatron_state``
gathers it at any TP). The families differ only by optional tensors: Qwen2
adds q/k/v biases, Qwen3 per-head q/k norms, and a model with tied embeddings
has no separate output layer. Two mappings are not one to one:

- attention: megatron fuses q, k and v into ``linear_qkv``, grouped by
  key/value head: [group 0: its q heads, k, v; group 1: ...]. HF keeps
  ``q_proj``, ``k_proj`` and ``v_proj`` apart (biases alike).
- the gated MLP: ``linear_fc1`` is [gate; up]; HF has ``gate_proj`` and ``up_proj``.

In a mixture-of-experts family each expert is such an MLP
(``mlp.experts.local_experts.<e>``), and ``mlp.router`` scores them. HF names
them per family: Qwen3-MoE ``mlp.experts.<e>.{gate,up,down}_proj`` and
``mlp.gate``, Mixtral ``block_sparse_moe.experts.<e>.{w1,w3,w2}`` and
``block_sparse_moe.gate`` (the per-expert keys transformers 5 writes on save).
A checkpoint may instead hold the layout transformers 5 keeps in memory: a
layer's experts stacked, ``mlp.experts.gate_up_proj`` [experts, gate rows then
up rows, hidden] and ``mlp.experts.down_proj`` [experts, hidden, width], with
the router at ``mlp.gate`` for both families; ``stacked_experts`` says where
each per-expert key's tensor lies in it, and the importer reads either.

``one_to_one`` lists the plain pairs, layer by layer; the importer and the
exporter both read these tables, so the two directions cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_rl.architecture import Architecture
from elastic_rl.layer_names import EMBEDDING

OUTPUT = "output_layer.weight"
HF_EMBEDDING = "model.embed_tokens.weight"
HF_OUTPUT = "lm_head.weight"


@dataclass(frozen=True)
class HfExperts:
    """Where a mixture-of-experts family keeps its router and experts in an HF checkpoint."""

    block: str
    """The layer's MoE block: the router is ``<block>.gate``, expert e is ``<block>.experts.<e>``."""
    projections: dict[str, str]
    """gate, up and down -> the family's name for that projection."""

    def weight(self, hf_layer_prefix: str, expert: int, projection: str) -> str:
        return f"{hf_layer_prefix}{self.block}.experts.{expert}.{self.projections[projection]}.weight"


HF_EXPERTS = {
    "qwen3_moe": HfExperts("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": HfExperts("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def megatron_layer(layer: int) -> str:
    return f"decoder.layers.{layer}."


def hf_layer(layer: int) -> str:
    return f"model.layers.{layer}."


def one_to_one(arch: Architecture) -> dict[str, str]:
    """Megatron name -> HF name of every tensor copied as it is (TP slicing aside)."""
    pairs = {EMBEDDING: HF_EMBEDDING, "decoder.final_layernorm.weight": "model.norm.weight"}
    if not arch.tie_embeddings:
        pairs[OUTPUT] = HF_OUTPUT
    for layer in range(arch.num_layers):
        src, dst = megatron_layer(layer), hf_layer(layer)
        pairs[src + "input_layernorm.weight"] = dst + "input_layernorm.weight"
        pairs[src + "self_attention.linear_proj.weight"] = dst + "self_attn.o_proj.weight"
        pairs[src + "pre_mlp_layernorm.weight"] = dst + "post_attention_layernorm.weight"
        if arch.experts is None:
            pairs[src + "mlp.linear_fc2.weight"] = dst + "mlp.down_proj.weight"
        else:
            hf_moe = HF_EXPERTS[arch.family]
            pairs[src + "mlp.router.weight"] = f"{dst}{hf_moe.block}.gate.weight"
            for expert in range(arch.experts.count):
                pairs[f"{src}mlp.experts.local_experts.{expert}.linear_fc2.weight"] = hf_moe.weight(dst, expert, "down")
        if arch.qk_norm:
            pairs[src + "self_attention.q_layernorm.weight"] = dst + "self_attn.q_norm.weight"
            pairs[src + "self_attention.k_layernorm.weight"] = dst + "self_attn.k_norm.weight"
    return pairs


def fused_qkv(arch: Architecture) -> dict[str, tuple[str, str, str]]:
    """Megatron ``linear_qkv`` weight (and bias) -> the HF q, k and v tensors it fuses."""
    fused = {}
    kinds = ("weight", "bias") if arch.qkv_bias else ("weight",)
    for layer in range(arch.num_layers):
        src, dst = megatron_layer(layer), hf_layer(layer)
        for kind in kinds:
            fused[f"{src}self_attention.linear_qkv.{kind}"] = tuple(
                f"{dst}self_attn.{p}_proj.{kind}" for p in ("q", "k", "v")
            )
    return fused


def gated_fc1(arch: Architecture) -> dict[str, tuple[str, str]]:
    """Megatron ``linear_fc1`` (the MLP's, or each expert's) -> the HF gate and up projections it stacks."""
    if arch.experts is None:
        return {
            f"{megatron_layer(layer)}mlp.linear_fc1.weight": (
                f"{hf_layer(layer)}mlp.gate_proj.weight",
                f"{hf_layer(layer)}mlp.up_proj.weight",
            )
            for layer in range(arch.num_layers)
        }
    hf_moe = HF_EXPERTS[arch.family]
    return {
        f"{megatron_layer(layer)}mlp.experts.local_experts.{expert}.linear_fc1.weight": (
            hf_moe.weight(hf_layer(layer), expert, "gate"),
            hf_moe.weight(hf_layer(layer), expert, "up"),
        )
        for layer in range(arch.num_layers)
        for expert in range(arch.experts.count)
    }


@dataclass(frozen=True)
class StackedPart:
    """Where a per-expert HF tensor lies in a checkpoint whose experts are stacked."""

    name: str
    """The stacked tensor's key (or, for the router, its key in that layout)."""
    expert: int | None = None
    """Its index along the stacked tensor's first dimension; None: the tensor is the whole of ``name``."""
    first_row: int = 0
    """Gate rows come first in ``gate_up_proj``, then up's, at the expert's width."""
    rows: int | None = None
    """How many rows are its own; None: all of them."""


STACKED_BLOCK = "mlp"


def stacked_experts(arch: Architecture) -> dict[str, StackedPart]:
    """Per-expert HF key (and router key) -> its part of the stacked layout."""
    if arch.experts is None:
        return {}
    hf_moe, width = HF_EXPERTS[arch.family], arch.experts.ffn_hidden_size
    parts = {}
    for layer in range(arch.num_layers):
        prefix = f"{hf_layer(layer)}{STACKED_BLOCK}."
        parts[f"{hf_layer(layer)}{hf_moe.block}.gate.weight"] = StackedPart(f"{prefix}gate.weight")
        for expert in range(arch.experts.count):
            gate_up, down = f"{prefix}experts.gate_up_proj", f"{prefix}experts.down_proj"
            parts[hf_moe.weight(hf_layer(layer), expert, "gate")] = StackedPart(gate_up, expert, 0, width)
            parts[hf_moe.weight(hf_layer(layer), expert, "up")] = StackedPart(gate_up, expert, width, width)
            parts[hf_moe.weight(hf_layer(layer), expert, "down")] = StackedPart(down, expert)
    return parts


def query_groups(arch: Architecture) -> tuple[int, int]:
    """(q heads per key/value group, rows of one head)."""
    return arch.num_attention_heads // arch.num_query_groups, arch.head_dim
