"""The ``model`` section: the policy model, a pretrained HF checkpoint or a toy Llama built from scratch."""

from __future__ import annotations

from pathlib import Path

from pydantic import PositiveFloat, PositiveInt, field_validator, model_validator

from elastic_rl.architecture import Architecture, from_hf_config
from elastic_rl.errors import SpecError
from elastic_rl.spec.base import Component, existing_checkpoint, existing_file


class ModelSpec(Component):
    """The policy model: a pretrained HF checkpoint, or a small Llama built from scratch."""

    hf_checkpoint: Path | None = None
    """A folder with config.json, safetensors weights and tokenizer files (Llama, Qwen2 or Qwen3).
    The architecture, tokenizer and chat template come from it; without it the toy model below is
    built from scratch with the toy tokenizer."""
    hidden_size: PositiveInt = 64
    """Toy model only: width of the residual stream."""
    num_layers: PositiveInt = 2
    """Toy model only: number of transformer blocks."""
    num_attention_heads: PositiveInt = 4
    """Toy model only: query heads per attention layer."""
    num_query_groups: PositiveInt = 2
    """Toy model only: key/value heads (grouped-query attention); divides num_attention_heads."""
    ffn_hidden_size: PositiveInt = 128
    """Toy model only: inner width of the SwiGLU MLP."""
    max_position_embeddings: PositiveInt = 128
    """Toy model only: longest sequence (prompt plus response) the model sees."""
    rope_theta: PositiveFloat = 10000.0
    """Toy model only: base of the rotary position embedding."""
    norm_epsilon: PositiveFloat = 1e-5
    """Toy model only: epsilon of every RMSNorm."""
    init_method_std: PositiveFloat = 0.02
    """Toy model only: standard deviation of the random initialisation."""
    tokenizer: Path | None = None
    """Toy model only: a tokenizer.json to use; by default the toy tokenizer is made in code."""

    _tokenizer_exists = field_validator("tokenizer")(existing_file)
    _checkpoint_exists = field_validator("hf_checkpoint")(existing_checkpoint)

    @model_validator(mode="after")
    def _one_kind_of_model(self) -> ModelSpec:
        if self.hf_checkpoint is not None:
            # Compared with the defaults, not with the keys given: a resolved spec, dumped and
            # loaded again (etcd, spec.json), holds every default.
            toy_fields = sorted(
                name
                for name, field in type(self).model_fields.items()
                if name != "hf_checkpoint" and getattr(self, name) != field.default
            )
            if toy_fields:
                raise ValueError(
                    f"{', '.join(toy_fields)}: set only for the toy model; with hf_checkpoint the "
                    f"architecture and tokenizer come from the checkpoint, so remove them"
                )
            try:
                from_hf_config(self.hf_checkpoint)
            except SpecError as exc:
                raise ValueError("; ".join(exc.problems)) from None
            return self
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_query_groups ({self.num_query_groups})"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        return self

    @property
    def context_length(self) -> int:
        """Longest sequence, prompt plus response, that the model takes."""
        if self.hf_checkpoint is None:
            return self.max_position_embeddings
        return from_hf_config(self.hf_checkpoint).max_position_embeddings

    def toy_architecture(self, vocab_size: int) -> Architecture:
        """The from-scratch Llama model these fields describe, for a tokenizer of ``vocab_size`` tokens."""
        return Architecture(
            family="llama",
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            head_dim=self.hidden_size // self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            norm_epsilon=self.norm_epsilon,
            init_method_std=self.init_method_std,
        )
