"""Builds the policy as a megatron-core ``GPTModel`` from an ``Architecture``.

RMSNorm, SwiGLU, rotary embeddings and grouped-query attention, with the
features the supported families add: q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3), tied input/output embeddings and linear or llama3 rope
scaling. A from-scratch model is initialised on the CPU from the full
(unsharded) tensors, so a given seed gives the same model at every
tensor-parallel size and on either kind of device; a pretrained one is filled
by ``convert.hf_import``; the caller then moves it to the process's device.

With pipeline parallelism (megatron's pipeline groups hold more than one rank)
each rank builds its stage: its share of the layers, the embedding on the
first stage, the final norm and output layer on the last (with a tied
embedding the last stage keeps a copy, its gradient summed with the first
stage's, ``model.pipeline``). ``build_gpt(..., whole=True)`` builds every
layer whatever the pipeline size: a from-scratch model's stage is taken from it
(``model.stages``), so a seed gives the same model at every layout.

Each process joins its groups with the backend of the device erld assigned
it (``elastic_rl.device``): gloo with the CPU shim on a CPU slot, NCCL on a
GPU. In bf16 the forward pass runs under megatron's autocast (bf16 matrix
products over fp32 parameters and gradients); logits are turned into log
probabilities in fp32 (``vocab_parallel``).

Attention is torch's fused kernel by default (``model.attention``), and the
trainer's passes take micro-batches padded or packed (``model.packing``), a
mixture of experts' replayed routing with them (``model.routing_replay``):
``decoder_states`` runs one and returns the final hidden states of the
positions it scores, which ``model.token_scores`` turns into log probs without
holding every logit at once. ``ModelOptions.recompute`` asks megatron to
compute activations again in the backward pass.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from torch.distributed import TCPStore

from elastic_rl.architecture import Architecture
from elastic_rl.atomic import write_file_atomic
from elastic_rl.device import activate, assigned
from elastic_rl.jobenv import RENDEZVOUS
from elastic_rl.model.attention import FusedAttention, block_spec, layer_spec
from elastic_rl.model.context_parallel import context_ranks
from elastic_rl.model.cpu_shim import apply_cpu_shim, cuda_calls_on_cpu
from elastic_rl.model.packing import ModelInput
from elastic_rl.model.routing_replay import replaying
from elastic_rl.model.swiglu import use_eager_swiglu
from elastic_rl.spec.trainer import Attention, Recompute, TrainerSpec
from policies.devices import DeviceKind, Precision, ProcessDevice

SELECTIVE_MODULES = ["core_attn", "mlp"]
"""What ``Recompute.SELECTIVE`` computes again: each layer's core attention and its dense MLP (megatron recomputes
its norms only with Transformer Engine)."""


@dataclass(frozen=True)
class ModelOptions:
    """How the policy is built for training: what the model reads of the ``trainer`` section."""

    precision: Precision = Precision.FP32
    attention: Attention = Attention.SDPA
    recompute: Recompute = Recompute.NONE
    aux_loss_coef: float = 0.0
    """A mixture of experts' load-balancing loss (``trainer.moe_aux_loss_coef``)."""
    sequence_parallel: bool = False
    """megatron's sequence parallelism (``trainer.sequence_parallel``)."""

    @classmethod
    def of(cls, trainer: TrainerSpec) -> ModelOptions:
        return cls(
            trainer.dtype, trainer.attention, trainer.recompute, trainer.moe_aux_loss_coef, trainer.sequence_parallel
        )


DEFAULT_OPTIONS = ModelOptions()
"""fp32, fused attention, nothing recomputed: the policy as tests, benchmarks and exports build it."""


def transformer_config(
    arch: Architecture,
    tensor_parallel: int,
    precision: Precision = Precision.FP32,
    pipeline_parallel: int = 1,
    aux_loss_coef: float = 0.0,
    recompute: Recompute = Recompute.NONE,
    sequence_parallel: bool = False,
) -> TransformerConfig:
    """megatron's config of ``arch``: built with fp32 parameters always; in bf16 the forward pass autocasts,
    in bf16-params megatron's Float16Module casts the parameters afterwards (``trainer.master_weights``).
    ``aux_loss_coef``: a mixture of experts' load-balancing loss (``trainer.moe_aux_loss_coef``)."""
    mixed = precision is Precision.BF16
    config = TransformerConfig(
        **_experts_config(arch, aux_loss_coef),
        **_recompute_config(recompute),
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        ffn_hidden_size=arch.ffn_hidden_size,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_method_std,
        tensor_model_parallel_size=tensor_parallel,
        sequence_parallel=sequence_parallel,
        # Each sample split over the replica's context-parallel ranks (``model.context_parallel``).
        context_parallel_size=context_ranks(),
        pipeline_model_parallel_size=pipeline_parallel,
        # One send or receive at a time, on gloo and NCCL alike.
        batch_p2p_comm=False,
        # The trainer normalises each micro-batch's loss by the global batch itself (algo.losses).
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
        # Also for a model an importer fills: megatron marks the tensor-parallel weights while it
        # initialises them, and the importer and the gather both read those marks.
        perform_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        # bf16-params: megatron's bf16 parameters (Float16Module casts the model after this fp32 build); its
        # attention then takes the softmax in fp32.
        bf16=precision is Precision.BF16_PARAMS,
        fp16=False,
        # megatron's autocast mixed precision: its layers' custom_fwd/custom_bwd keep the backward in step.
        enable_autocast=mixed,
        autocast_dtype=torch.bfloat16 if mixed else None,
        gradient_accumulation_fusion=False,
        # megatron's SwiGLUFunction, which keeps only its input for the backward pass (``model.swiglu``).
        bias_activation_fusion=True,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    # Micro-batches are cut to their longest sample and sized by a token budget, so stages tell each other
    # every activation's shape. Set after the checks: they refuse it beside the default MoE token
    # dispatcher, which a dense model never runs.
    config.variable_seq_lengths = pipeline_parallel > 1
    return config


def _recompute_config(recompute: Recompute) -> dict:
    """megatron's activation recomputation for ``trainer.recompute``: full runs each layer again from its input."""
    if recompute is Recompute.SELECTIVE:
        return {"recompute_granularity": "selective", "recompute_modules": list(SELECTIVE_MODULES)}
    if recompute is Recompute.FULL:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def _experts_config(arch: Architecture, aux_loss_coef: float) -> dict:
    """megatron's mixture-of-experts settings for ``arch`` (none for a dense model)."""
    if arch.experts is None:
        return {}
    return {
        "num_moe_experts": arch.experts.count,
        "moe_router_topk": arch.experts.per_token,
        "moe_ffn_hidden_size": arch.experts.ffn_hidden_size,
        # megatron's default takes the top k scores, then a softmax over them (renormalised); its
        # pre-softmax takes each chosen expert's share of the softmax over all of them.
        "moe_router_pre_softmax": not arch.experts.renormalised,
        # Each expert its own MLP, its tokens gathered from every rank: the dispatcher megatron runs
        # without CUDA streams, and the experts without grouped GEMM kernels.
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        # The experts split over the ranks megatron's groups give them (what marks their parameters as not
        # summed over the data-parallel ranks).
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "moe_router_load_balancing_type": "aux_loss" if aux_loss_coef > 0 else "none",
        "moe_aux_loss_coeff": aux_loss_coef,
    }


def build_gpt(
    arch: Architecture, tensor_parallel: int = 1, options: ModelOptions = DEFAULT_OPTIONS, whole: bool = False
) -> GPTModel:
    """This rank's stage of the model, on the CPU, with random weights from the seeded RNG; with
    ``whole``, every layer. Model parallelism must be initialised first. The logits stay sharded over
    the vocabulary (see ``vocab_parallel``).
    """
    if arch.vocab_size % tensor_parallel:
        raise ValueError(f"vocab size {arch.vocab_size} is not divisible by tensor_parallel {tensor_parallel}")
    if arch.experts is not None and not hasattr(moe_utils, "te_general_gemm"):
        # megatron's router picks Transformer Engine's GEMM with `te_general_gemm is not None`, a name
        # it defines only when Transformer Engine imports (on any device): None takes its torch path.
        moe_utils.te_general_gemm = None
    use_eager_swiglu()
    stages = 1 if whole else parallel_state.get_pipeline_model_parallel_world_size()
    if arch.num_layers % stages:
        raise ValueError(f"{arch.num_layers} layers do not divide into pipeline_parallel {stages} stages")
    scaling = arch.rope_scaling
    # A tied embedding's copy on the last stage is summed with the first stage's as the model is made, on
    # the device of the groups' backend (gloo: CPU slots).
    on_cpu = stages > 1 and torch.distributed.get_backend() == torch.distributed.Backend.GLOO
    with cuda_calls_on_cpu() if on_cpu else contextlib.nullcontext():
        config = transformer_config(
            arch,
            tensor_parallel,
            options.precision,
            stages,
            options.aux_loss_coef,
            options.recompute,
            options.sequence_parallel,
        )
        layer = layer_spec(options.attention, arch.experts.count if arch.experts else None, arch.qk_norm)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(layer, config),
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=whole or parallel_state.is_pipeline_first_stage(),
            post_process=whole or parallel_state.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            seq_len_interpolation_factor=scaling.factor if scaling is not None and scaling.kind == "linear" else None,
        )
    if scaling is not None and scaling.kind == "llama3":
        rotary = model.rotary_pos_emb
        rotary.inv_freq = rotary._apply_scaling(
            rotary.inv_freq,
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    return model


def init_model_parallel(
    tensor_parallel: int,
    seed: int,
    init_method: str | None = None,
    timeout_s: float = 300.0,
    device: ProcessDevice | None = None,
    pipeline_parallel: int = 1,
    expert_parallel: int = 1,
    context_parallel: int = 1,
) -> None:
    """Join the process group and set up megatron's groups, every collective bounded by ``timeout_s``.

    Under erld (``ERL_RENDEZVOUS`` set) the group meets at a store rank 0
    opens (``rendezvous_store``); otherwise with no ``init_method`` it comes
    from torchrun-style environment variables, and a ``tcp://`` init method
    makes a single-process group. ``device`` (by default the one erld
    assigned) decides the backend: on a CPU slot gloo, with the CPU shim; on a
    GPU NCCL, with megatron's CUDA RNG streams.
    """
    device = device or assigned()
    activate(device)
    if not torch.distributed.is_initialized():
        backend = device.backend.value
        timeout = timedelta(seconds=timeout_s)
        if os.environ.get(RENDEZVOUS):
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = rendezvous_store(rank, world, os.environ["MASTER_ADDR"], Path(os.environ[RENDEZVOUS]), timeout)
            torch.distributed.init_process_group(
                backend=backend, store=store, rank=rank, world_size=world, timeout=timeout
            )
        else:
            single = {"world_size": 1, "rank": 0} if init_method else {}
            torch.distributed.init_process_group(backend=backend, init_method=init_method, timeout=timeout, **single)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
        context_parallel_size=context_parallel,
        distributed_timeout_minutes=timeout_s / 60,
    )
    if device.kind is DeviceKind.CPU:
        apply_cpu_shim(seed)
    else:
        model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def rendezvous_store(rank: int, world_size: int, host: str, path: Path, timeout: timedelta) -> TCPStore:
    """The replica group's store: rank 0 binds a port the OS picks, writes it to ``path`` (in the
    shared work dir; the group's ranks share a node), and the others read it there. A port chosen
    in advance could be taken by any process in the seconds the imports take. MASTER_PORT is set
    to it, where torchft's Manager looks for the store."""
    if rank == 0:
        store = TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
        write_file_atomic(path, str(store.port).encode())
    else:
        deadline = time.monotonic() + timeout.total_seconds()
        while not path.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 of the group did not open its store ({path}) in time")
            time.sleep(0.05)
        store = TCPStore(host, int(path.read_text()), world_size, is_master=False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)
    return store


def destroy_model_parallel() -> None:
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def forward_gpt(model: GPTModel, tokens: torch.Tensor, first_logit: int = 0) -> torch.Tensor:
    """This rank's logits ``[batch, seq - first_logit, vocab/tp]`` of the positions from
    ``first_logit`` on, on the model's device (``tokens`` go there), in bf16 when the model autocasts:
    the rows of ``tokens`` right-padded (a causal model's real tokens never see the padding)."""
    tokens = tokens.to(model_device(model))
    with _precision(model), _selecting(model, lambda hidden: hidden[first_logit:]):
        return model(tokens, _positions(tokens), attention_mask=_causal_mask(model, tokens))


def decoder_states(model: GPTModel, item: ModelInput, last_stage: bool = True) -> torch.Tensor:
    """A micro-batch through the model (or this pipeline stage): the final hidden states of the positions it
    scores, ``[batch, scored, hidden]``; a stage before the last returns its output activations
    ``[seq, batch, hidden]`` for the next. The logits are left to ``token_scores``."""
    tokens = item.tokens.to(model_device(model))
    packed = item.seq_params(tokens.device)
    mask = None if packed is not None else _causal_mask(model, tokens)
    if not last_stage:
        with _precision(model), replaying(model, item.routing):
            return model(tokens, _positions(tokens), attention_mask=mask, packed_seq_params=packed)
    with (
        _precision(model),
        replaying(model, item.routing),
        _selecting(model, lambda hidden: item.select(_whole_sequence(model, hidden))),
        _without_output_layer(model),
    ):
        hidden = model(tokens, _positions(tokens), attention_mask=mask, packed_seq_params=packed)
    return hidden.transpose(0, 1)


def _whole_sequence(model: GPTModel, hidden: torch.Tensor) -> torch.Tensor:
    """The decoder's output with every position: with sequence parallelism each tensor-parallel rank holds a
    slice of the sequence, gathered here as megatron's output layer would gather it (its backward pass sums
    the gradient over the ranks, each of which scores its slice of the vocabulary, and keeps this rank's
    slice of the sequence)."""
    if not model.config.sequence_parallel:
        return hidden
    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    # Only learned absolute embeddings read these: rotary ones take each position (packed: within its sample).
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def _causal_mask(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor | None:
    """The ``[seq, seq]`` causal mask megatron's own attention needs (True = hidden; its default is built on
    the GPU); none for the fused attention, which is causal by itself."""
    if _attends_fused(model):
        return None
    seq = tokens.shape[1]
    return torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(diagonal=1)[None, None]


def _attends_fused(model: GPTModel) -> bool:
    return isinstance(model.decoder.layers[0].self_attention.core_attention, FusedAttention)


def _precision(model: GPTModel):
    """megatron's autocast where the model's config asks for it."""
    config = model.config
    if not config.enable_autocast:
        return contextlib.nullcontext()
    return torch.autocast(model_device(model).type, dtype=config.autocast_dtype)


@contextlib.contextmanager
def _selecting(model: GPTModel, select):
    """Within the block, the decoder's output (``[seq, batch, hidden]``) is ``select(output)``: only the
    positions that are scored, so the output layer (a third of a small model's step, its vocabulary being
    large) computes no logits that are not wanted. megatron's GPTModel has no option for this
    (transformers calls it ``logits_to_keep``); a forward hook on the decoder cuts its output instead."""
    handle = model.decoder.register_forward_hook(lambda _module, _inputs, hidden: select(hidden))
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _without_output_layer(model: GPTModel):
    """Within the block the model returns the decoder's output (after its final norm), as a stage before
    the last does, instead of the logits: ``token_scores`` applies the output layer, a chunk at a time
    where the whole logits would not fit."""
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = True
