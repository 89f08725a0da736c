"""Megatron's canonical state to a Hugging Face checkpoint folder that transformers and SGLang load.

``to_hf_state`` turns the canonical (TP=1 layout) state into the family's HF
tensors; ``write_hf_checkpoint`` writes them as safetensors beside the files
that describe the model (config.json, tokenizer, chat template), atomically.
Those files come from the pretrained checkpoint the job started from, with the
dtype set to the float32 the trainer exports, or are made for the toy model.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, PreTrainedTokenizerBase

from elastic_rl.architecture import CONFIG_FILE, Architecture
from elastic_rl.atomic import atomic_directory
from elastic_rl.model.convert.layout import fused_qkv, gated_fc1, one_to_one, query_groups
from elastic_rl.model.tokenizer import save_tokenizer

WEIGHTS_FILE = "model.safetensors"
# Files of a source checkpoint that hold weights: never copied beside exported ones.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")


def split_qkv(fused: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's group-ordered ``linear_qkv`` weight or bias -> HF's q, k and v."""
    per_group, head_dim = query_groups(arch)
    trailing = fused.shape[1:]
    grouped = fused.reshape(arch.num_query_groups, per_group + 2, head_dim, *trailing)
    q = grouped[:, :per_group].reshape(-1, *trailing)
    k = grouped[:, per_group].reshape(-1, *trailing)
    v = grouped[:, per_group + 1].reshape(-1, *trailing)
    return q, k, v


def to_hf_state(state: dict[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """The HF tensors of a canonical megatron state; every canonical tensor must be used."""
    hf = {dst: state[src] for src, dst in one_to_one(arch).items()}
    for src, names in fused_qkv(arch).items():
        hf.update(zip(names, split_qkv(state[src], arch)))
    for src, (gate, up) in gated_fc1(arch).items():
        hf[gate], hf[up] = state[src].chunk(2, dim=0)
    used = set(one_to_one(arch)) | set(fused_qkv(arch)) | set(gated_fc1(arch))
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(f"the {arch.family} exporter has no HF name for {unused[:5]}")
    return {name: tensor.contiguous() for name, tensor in hf.items()}


class CheckpointFiles(Protocol):
    """Writes the files that describe a model (config, tokenizer) into an exported checkpoint folder."""

    def write(self, folder: Path) -> None: ...


@dataclass(frozen=True)
class PretrainedFiles:
    """The source checkpoint's own config, tokenizer, chat template and generation config."""

    source: Path

    def write(self, folder: Path) -> None:
        for item in sorted(self.source.iterdir()):
            if item.is_file() and item.name != CONFIG_FILE and not item.name.endswith(WEIGHT_SUFFIXES):
                shutil.copyfile(item, folder / item.name)
        config = orjson.loads((self.source / CONFIG_FILE).read_bytes())
        # The trainer exports float32, whatever the source was stored in.
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = "float32"
        (folder / CONFIG_FILE).write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))


@dataclass(frozen=True)
class ToyFiles:
    """A LlamaConfig and the toy tokenizer for the from-scratch model."""

    arch: Architecture
    tokenizer: PreTrainedTokenizerBase

    def write(self, folder: Path) -> None:
        arch, tokenizer = self.arch, self.tokenizer
        LlamaConfig(
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.ffn_hidden_size,
            num_hidden_layers=arch.num_layers,
            num_attention_heads=arch.num_attention_heads,
            num_key_value_heads=arch.num_query_groups,
            head_dim=arch.head_dim,
            max_position_embeddings=arch.max_position_embeddings,
            rms_norm_eps=arch.norm_epsilon,
            rope_theta=arch.rope_theta,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            torch_dtype="float32",
            architectures=[arch.hf_class],
        ).save_pretrained(str(folder))
        save_tokenizer(tokenizer, folder)


def write_hf_checkpoint(directory: Path, hf_state: dict[str, torch.Tensor], files: CheckpointFiles) -> Path:
    """Write an HF checkpoint (safetensors plus the describing files) to ``directory``, atomically."""
    with atomic_directory(directory) as temp:
        save_file(hf_state, str(temp / WEIGHTS_FILE), metadata={"format": "pt"})
        files.write(temp)
    return directory
