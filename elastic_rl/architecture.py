"""The shape of the policy model: read from an HF checkpoint's config.json, or the toy spec's fields.

Everything that builds, imports or exports a model takes an ``Architecture``:
the family (which HF layout the weights come from and go back to), the sizes,
and the few features the supported families differ by (q/k/v bias, q/k norm,
tied embeddings, rope scaling). It reads config.json as plain JSON, without
transformers or torch, so `erl validate` can reject an unsupported checkpoint
in well under a second. It sits below the spec and the model, which both read it.

Supported families: ``LlamaForCausalLM`` (tied embeddings and rope scaling of
type linear or llama3 included), ``Qwen2ForCausalLM`` (q/k/v bias),
``Qwen3ForCausalLM`` (per-head q/k RMSNorm), and two mixture-of-experts
families, ``Qwen3MoeForCausalLM`` (Qwen3's attention, every layer's MLP a set
of experts) and ``MixtralForCausalLM`` (Llama's attention, likewise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from elastic_rl.errors import SpecError

CONFIG_FILE = "config.json"
# A gated MLP's input projection (the dense MLP's, or an expert's): the one weight whose layout depends
# on tensor parallelism (each rank holds [its gate rows; its up rows]; the full layout is [all gate; all up]).
GATED_FC1_SUFFIX = "linear_fc1.weight"

# HF class name -> family name; the families the importer and exporter know.
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MIXTURE_OF_EXPERTS = ("qwen3_moe", "mixtral")
# Rope scalings that only change the inverse frequencies (no attention factor, no length dependence).
ROPE_SCALINGS = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    kind: str
    """linear or llama3."""
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP: each token goes to its ``per_token`` highest-scoring experts."""

    count: int
    per_token: int
    ffn_hidden_size: int
    """Inner width of each expert's SwiGLU MLP."""
    renormalised: bool
    """The chosen experts' weights are a softmax over their own scores (Mixtral; Qwen3-MoE's
    ``norm_topk_prob``); otherwise each keeps its share of the softmax over every expert."""


@dataclass(frozen=True)
class Architecture:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_epsilon: float
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    init_method_std: float = 0.02
    experts: Experts | None = None
    """Every layer's MLP a mixture of experts; None: a dense MLP of ffn_hidden_size."""

    @property
    def hf_class(self) -> str:
        return next(name for name, family in FAMILIES.items() if family == self.family)

    def check_tensor_parallel(self, tensor_parallel: int) -> list[str]:
        """What stops this model from being split into ``tensor_parallel`` ranks (empty if nothing)."""
        problems = []
        ffn = ("moe_intermediate_size", self.experts.ffn_hidden_size) if self.experts else None
        for what, value in (
            ("num_query_groups (key/value heads)", self.num_query_groups),
            ("vocab_size", self.vocab_size),
            ffn or ("ffn_hidden_size", self.ffn_hidden_size),
        ):
            if value % tensor_parallel:
                problems.append(f"{what} ({value}) is not a multiple of trainer.tensor_parallel ({tensor_parallel})")
        return problems


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise SpecError([f"{folder}: no {CONFIG_FILE}; give the folder of an HF checkpoint"])
    try:
        config = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise SpecError([f"{path}: not valid JSON ({exc})"]) from None
    if not isinstance(config, dict):
        raise SpecError([f"{path}: a config is a JSON object"])
    return config


def _rope(config: dict[str, Any], where: Path) -> tuple[float, RopeScaling | None]:
    """The rope base and scaling, from transformers 5's ``rope_parameters`` or the older keys."""
    parameters = dict(config.get("rope_parameters") or {})
    theta = float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = parameters if parameters.get("rope_type", "default") != "default" else config.get("rope_scaling")
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALINGS:
        raise SpecError([f"{where}: rope scaling {kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}"])
    extra = {}
    if kind == "llama3":
        extra = {
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
        }
    return theta, RopeScaling(kind, float(scaling["factor"]), **extra)


def from_hf_config(folder: Path) -> Architecture:
    """The architecture of the HF checkpoint in ``folder``; a ``SpecError`` names what is unsupported."""
    config = read_hf_config(folder)
    where = folder / CONFIG_FILE
    classes = config.get("architectures") or []
    family = FAMILIES.get(classes[0]) if classes else None
    if family is None:
        raise SpecError(
            [
                f"{where}: architecture {classes[0] if classes else 'missing'!r} is not supported; "
                f"supported: {', '.join(FAMILIES)}"
            ]
        )
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config['hidden_act']!r} (only silu)")
    if config.get("mlp_bias"):
        problems.append("mlp_bias")
    if family != "qwen2" and config.get("attention_bias"):
        problems.append("attention_bias (a bias on the output projection too)")
    if config.get("use_sliding_window") or (family == "mixtral" and config.get("sliding_window")):
        problems.append("a sliding attention window")
    if family == "qwen3_moe" and (config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1):
        problems.append("dense MLP layers among the experts' (mlp_only_layers, decoder_sparse_step)")
    if problems:
        raise SpecError([f"{where}: {family} with {', '.join(problems)} is not supported"])
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    theta, scaling = _rope(config, where)
    return Architecture(
        family=family,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        max_position_embeddings=int(config["max_position_embeddings"]),
        rope_theta=theta,
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        rope_scaling=scaling,
        init_method_std=float(config.get("initializer_range", 0.02)),
        experts=_experts(config, family),
    )


def _experts(config: dict[str, Any], family: str) -> Experts | None:
    if family not in MIXTURE_OF_EXPERTS:
        return None
    return Experts(
        count=int(config.get("num_local_experts") or config["num_experts"]),
        per_token=int(config["num_experts_per_tok"]),
        ffn_hidden_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        renormalised=family == "mixtral" or bool(config.get("norm_topk_prob", False)),
    )
