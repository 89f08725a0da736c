"""Converters from megatron's canonical state to Hugging Face checkpoints, by architecture.

A converter module provides ``hf_config(spec, vocab_size, tokenizer)`` and
``to_hf_state(state, spec)``; ``export_hf`` writes what they return as a folder
that ``transformers`` and SGLang load. Qwen2 and Qwen3 converters are added to
``CONVERTERS`` beside ``llama``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from elastic_rl.atomic import atomic_directory
from elastic_rl.config import ModelSpec
from elastic_rl.model.convert import llama
from elastic_rl.model.tokenizer import save_tokenizer

CONVERTERS: dict[str, ModuleType] = {"llama": llama}

WEIGHTS_FILE = "model.safetensors"


def export_hf(
    directory: Path,
    state: dict[str, torch.Tensor],
    spec: ModelSpec,
    vocab_size: int,
    tokenizer: PreTrainedTokenizerFast,
) -> Path:
    """Write an HF checkpoint (safetensors, config.json, tokenizer) to ``directory``, atomically."""
    converter = CONVERTERS[spec.architecture]
    hf_state = {name: tensor.contiguous() for name, tensor in converter.to_hf_state(state, spec).items()}
    with atomic_directory(directory) as temp:
        save_file(hf_state, str(temp / WEIGHTS_FILE), metadata={"format": "pt"})
        converter.hf_config(spec, vocab_size, tokenizer).save_pretrained(str(temp))
        save_tokenizer(tokenizer, temp)
    return directory
