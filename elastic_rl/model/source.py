"""Where the policy starts: a pretrained HF checkpoint, or the toy model from the job's seed.

``ModelSource.from_spec`` reads the spec's model section once and gives every
process what it needs of the model: its architecture, its tokenizer, the
policy with its initial weights at a tensor-parallel size (built on the CPU,
then moved to the process's device, in the job's precision), the KL reference,
PPO's critic, and the export of trained weights as an HF checkpoint of the same family with
the same config, tokenizer and chat template.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from megatron.core import parallel_state
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from elastic_rl.architecture import Architecture, from_hf_config
from elastic_rl.atomic import atomic_directory
from elastic_rl.device import assigned
from elastic_rl.layer_names import take_stage
from elastic_rl.model.convert.hf_export import (
    CheckpointFiles,
    PretrainedFiles,
    ToyFiles,
    to_hf_state,
    write_hf_checkpoint,
)
from elastic_rl.model.convert.hf_import import import_hf_weights
from elastic_rl.model.gpt import DEFAULT_OPTIONS, ModelOptions, build_gpt
from elastic_rl.model.tokenizer import load_tokenizer, padded_vocab_size
from elastic_rl.model.value_head import attach_value_head
from elastic_rl.spec.model import ModelSpec
from elastic_rl.spec.trainer import Recompute

INITIAL_REFERENCE = "initial"


@dataclass(frozen=True)
class ModelSource:
    architecture: Architecture
    tokenizer: PreTrainedTokenizerBase
    files: CheckpointFiles
    checkpoint: Path | None
    """The pretrained weights; None for the toy model, initialised from the seed."""

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelSource:
        tokenizer = load_tokenizer(spec)
        if spec.hf_checkpoint is not None:
            arch = from_hf_config(spec.hf_checkpoint)
            return cls(arch, tokenizer, PretrainedFiles(spec.hf_checkpoint), spec.hf_checkpoint)
        arch = spec.toy_architecture(padded_vocab_size(tokenizer))
        return cls(arch, tokenizer, ToyFiles(arch, tokenizer), None)

    def _load(self, checkpoint: Path, options: ModelOptions) -> torch.nn.Module:
        model = build_gpt(self.architecture, _tp_size(), options)
        import_hf_weights(
            model, self.architecture, checkpoint, parallel_state.get_tensor_model_parallel_rank(), _tp_size()
        )
        return model

    def build_policy(
        self, options: ModelOptions = DEFAULT_OPTIONS, device: torch.device | str | None = None
    ) -> torch.nn.Module:
        """The policy on this rank with its initial weights, built as ``options`` say (the trainer's precision,
        attention, recomputation), on ``device`` (by default the one erld assigned this process). Model
        parallelism must be initialised."""
        if self.checkpoint is None:
            # The seed draws every layer in turn: with pipeline stages, a stage is taken from the whole model.
            model = build_gpt(self.architecture, _tp_size(), options, whole=True)
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                whole = model
                with torch.random.fork_rng(devices=[]):  # the stage's own draws leave no trace
                    model = build_gpt(self.architecture, _tp_size(), options)
                take_stage(model, whole)
        else:
            model = self._load(self.checkpoint, options)
        return model.to(device or assigned().torch_device)

    def build_reference(
        self,
        policy: torch.nn.Module,
        reference: str,
        options: ModelOptions = DEFAULT_OPTIONS,
        device: torch.device | str | None = None,
    ) -> torch.nn.Module:
        """The frozen KL reference on ``device`` (by default the process's): a copy of the freshly built
        policy, or another checkpoint.

        Call it before the policy trains or loads a snapshot: every replica, restarted
        or healed, then holds the same reference without a snapshot storing it. It runs no backward pass:
        nothing of it is recomputed, nor is its load-balancing loss kept.
        """
        options = replace(options, recompute=Recompute.NONE, aux_loss_coef=0.0)
        if reference == INITIAL_REFERENCE:
            model = build_gpt(self.architecture, _tp_size(), options)
            model.load_state_dict(policy.state_dict())
        else:
            model = self._load(Path(reference), options)
        return model.to(device or assigned().torch_device).eval().requires_grad_(False)

    def build_critic(
        self,
        policy: torch.nn.Module,
        checkpoint: Path | None,
        options: ModelOptions = DEFAULT_OPTIONS,
        device: torch.device | str | None = None,
    ) -> torch.nn.Module:
        """PPO's critic on ``device`` (by default the process's): a copy of the freshly built policy, or
        ``checkpoint`` (of the policy's architecture), with a zero value head (``model.value_head``). Trained,
        and so snapshotted and healed beside the policy."""
        if checkpoint is None:
            model = build_gpt(self.architecture, _tp_size(), options)
            model.load_state_dict(policy.state_dict())
        else:
            model = self._load(checkpoint, options)
        model = model.to(device or assigned().torch_device)
        attach_value_head(model)
        return model

    def link_as_export(self, directory: Path) -> int:
        """The pretrained checkpoint as the initial export, its weight files hard-linked (copied across
        filesystems); return the parameter count."""
        files = sorted(self.checkpoint.glob("*.safetensors")) + sorted(self.checkpoint.glob("*.safetensors.index.json"))
        with atomic_directory(directory) as temp:
            for file in files:
                try:
                    os.link(file, temp / file.name)
                except OSError:
                    shutil.copyfile(file, temp / file.name)
            self.files.write(temp)
        parameters = 0
        for file in self.checkpoint.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as handle:
                parameters += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
        return parameters

    def hf_state(self, canonical_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Trained weights (megatron's canonical state) under the family's HF names, as engines load them."""
        return to_hf_state(canonical_state, self.architecture)

    def export(self, directory: Path, canonical_state: dict[str, torch.Tensor]) -> Path:
        """Write trained weights (megatron's canonical state) as an HF checkpoint, atomically."""
        return write_hf_checkpoint(directory, self.hf_state(canonical_state), self.files)


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()
