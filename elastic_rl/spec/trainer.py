"""The ``trainer`` section: the Megatron trainer replicas, their batches and their optimizer."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from elastic_rl.spec.base import Component
from elastic_rl.spec.sizes import SizeRange
from policies.devices import Precision


class Attention(Enum):
    """How the policy computes attention (``trainer.attention``)."""

    SDPA = "sdpa"
    """torch's fused scaled_dot_product_attention: causal, no mask, memory linear in the sequence."""
    LOCAL = "local"
    """megatron's unfused DotProductAttention: the [heads, seq, seq] scores kept for the backward pass."""


class Recompute(Enum):
    """Which activations the backward pass computes again instead of keeping them (``trainer.recompute``)."""

    NONE = "none"
    SELECTIVE = "selective"
    """megatron's selective recomputation: each layer's core attention and dense MLP."""
    FULL = "full"
    """megatron's full recomputation: only each layer's input is kept; the layer runs again in the backward."""


class TrainerSpec(Component):
    """The Megatron trainer replicas."""

    replicas: SizeRange = SizeRange(min=1, max=1)
    """Trainer replicas joined by a torchft quorum: a number, or ``{min, max}`` for a job that starts
    with ``min`` and grows to ``max`` as slots come free (a new replica heals from a peer and joins
    the quorum at a step boundary)."""
    tensor_parallel: PositiveInt = 1
    """Tensor-parallel ranks inside one replica."""
    sequence_parallel: bool = False
    """With tensor_parallel > 1, megatron's sequence parallelism: the activations outside attention and
    the MLP (norms, residuals, dropout) are split along the sequence over the tensor-parallel ranks
    instead of held whole by each. A mixture of experts trains at tensor_parallel > 1 only with it."""
    context_parallel: PositiveInt = 1
    """Context-parallel ranks inside one replica, each holding a share of every sample: each packed sample
    is cut into 2 x context_parallel chunks, a rank holds two (one from the front, its mirror from the
    back), and attention gathers the keys and values of the others. A sequence longer than one rank's
    memory holds trains over several. Dense models, packed micro-batches, fp32 or bf16."""
    pipeline_parallel: PositiveInt = 1
    """Pipeline stages of one replica, each with an equal share of the layers (it divides the model's
    layers), run by megatron's one-forward-one-backward schedule over each step's micro-batches."""
    data_parallel: PositiveInt = 1
    """Data-parallel ranks inside one replica, each with its share of the replica's part of every batch
    (a replica holds tensor_parallel x context_parallel x pipeline_parallel x data_parallel ranks, all on
    one node). Across
    replicas the torchft quorum is the data parallelism that survives faults; inside one, these ranks
    come and go together."""
    expert_parallel: PositiveInt = 1
    """A mixture of experts only: each layer's experts split over this many of the replica's data-parallel
    ranks (it divides data_parallel and the experts), so each rank holds and updates 1/expert_parallel of
    them; megatron's all-gather dispatcher brings every token of those ranks to its experts' rank. The
    other data-parallel ranks (data_parallel / expert_parallel) hold the same experts."""
    shard_optimizer: bool = True
    """With data_parallel > 1, split AdamW's state across the replica's data-parallel ranks (each
    updates the parameters it owns and sends them to the others: torch's ZeroRedundancyOptimizer), so
    each rank holds 1/data_parallel of it. Off, every rank holds all of it."""
    optimizer_offload: bool = False
    """GPU slots, fp32 or bf16: AdamW's two moments live in host memory and its update runs there, one
    parameter at a time (copied to the host and back), so a rank's device holds 8 bytes a parameter
    (weights and gradients) instead of 16, and its host the moments (8, over data_parallel when sharded).
    The arithmetic is AdamW's; each step adds the copies' time. Placement puts the replicas on nodes
    started with `erl daemon --gpus` (on a CPU slot host memory is the device: there is nothing to move)."""
    global_batch_size: PositiveInt = 64
    """Samples in one optimizer step, summed over every replica."""
    micro_batch_size: PositiveInt = 16
    """Samples in one forward/backward pass (unless max_tokens_per_micro_batch is set)."""
    max_tokens_per_micro_batch: PositiveInt | None = None
    """Micro-batches of at most this many tokens each (a longer sample goes alone) instead of
    micro_batch_size samples each: packed, the samples' own tokens (slime's dynamic batch size);
    padded, samples times the longest one's length, the samples grouped by length. The gradient is
    the same either way (up to float rounding)."""
    packing: bool = True
    """Lay each micro-batch's samples end to end as one sequence, with no padding: attention stays
    within each sample and the rotary positions restart at each. false: pad each micro-batch to its
    longest sample (attention local needs it)."""
    attention: Attention = Attention.SDPA
    """sdpa: torch's fused attention (flash, memory-efficient or cuDNN on CUDA; the fused CPU kernel on
    the CPU), memory linear in the sequence; local: megatron's unfused attention, whose [heads, seq,
    seq] scores grow with the square of the sequence (the reference sdpa is checked against)."""
    recompute: Recompute = Recompute.NONE
    """Activations computed again in the backward pass instead of kept: none; selective (each layer's
    core attention and dense MLP, from their inputs); full (every layer from its input: the least
    memory, one more forward pass of the layers a step). Through megatron's own recomputation."""
    lr: PositiveFloat = 1e-3
    """Peak learning rate."""
    min_lr: float = Field(0.0, ge=0.0)
    """Learning rate at the end of the decay."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the schedule after warmup."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW beta1."""
    adam_beta2: float = Field(0.98, ge=0.0, lt=1.0)
    """AdamW beta2."""
    clip_grad: PositiveFloat = 1.0
    """Global gradient-norm clip."""
    moe_aux_loss_coef: float = Field(0.0, ge=0.0)
    """A mixture-of-experts model only: weight of megatron's load-balancing loss, which pushes each
    layer's router to spread the tokens evenly over its experts (0: none; Qwen3-MoE and Mixtral were
    trained with 0.001 and 0.02). Its gradient is the mean over a step's micro-batches."""
    cpu_threads: PositiveInt = 1
    """Torch threads of each trainer rank on a CPU node. More is faster where cores are free (in
    sync mode the engines idle while the trainers train); runs compared bit for bit need the same."""
    dtype: Precision = Precision.FP32
    """fp32; bf16: megatron's mixed precision (its autocast: bf16 matrix products over fp32
    parameters and gradients, so the optimizer and the cross-replica all-reduce stay fp32); or
    bf16-params: megatron's bf16 training, the parameters in bf16 (its Float16Module) and fp32 main
    weights and AdamW moments in its DistributedOptimizer, sharded over trainer.data_parallel, with
    fp32 gradients (its data-parallel buffers), so 6 bytes a parameter plus 12 / data_parallel.
    bf16 and bf16-params run only on GPU slots: placement puts the replicas on nodes started with
    `erl daemon --gpus`. Log probabilities, and their comparison with the engine's, are computed in
    fp32 either way."""

    @property
    def ranks_per_replica(self) -> int:
        """Processes, and device slots, of one replica."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel * self.data_parallel

    @model_validator(mode="after")
    def _experts_split_over_data_parallel_ranks(self) -> TrainerSpec:
        if self.data_parallel % self.expert_parallel:
            raise ValueError(
                f"trainer.expert_parallel ({self.expert_parallel}) must divide trainer.data_parallel "
                f"({self.data_parallel}): experts are split over the replica's data-parallel ranks"
            )
        if self.expert_parallel > 1 and self.shard_optimizer:
            # ZeroRedundancyOptimizer sends each parameter from the one rank that owns it to every other,
            # which would overwrite one rank's experts with another's.
            raise ValueError(
                "trainer.shard_optimizer with trainer.expert_parallel > 1 is not built: set "
                "trainer.shard_optimizer false (each rank then holds AdamW's state of its own experts only)"
            )
        return self

    @model_validator(mode="after")
    def _bf16_parameters_fit(self) -> TrainerSpec:
        if self.dtype is not Precision.BF16_PARAMS:
            return self
        problems = []
        if self.pipeline_parallel > 1:
            problems.append("set trainer.pipeline_parallel 1 (the tied embedding's sum between stages is not built)")
        if self.expert_parallel > 1:
            problems.append("set trainer.expert_parallel 1 (megatron's separate expert optimizer is not built)")
        if not self.shard_optimizer:
            problems.append("remove trainer.shard_optimizer false (megatron's distributed optimizer always shards)")
        if problems:
            raise ValueError(f"trainer.dtype bf16-params: {'; '.join(problems)}; or set trainer.dtype bf16")
        return self

    @model_validator(mode="after")
    def _offload_is_of_adamw(self) -> TrainerSpec:
        if self.optimizer_offload and self.dtype is Precision.BF16_PARAMS:
            raise ValueError(
                "trainer.optimizer_offload with trainer.dtype bf16-params is not built (megatron's distributed "
                "optimizer offloads through its HybridDeviceOptimizer, which this trainer does not drive): set "
                "trainer.dtype bf16 to offload AdamW's moments, or drop trainer.optimizer_offload"
            )
        return self

    @model_validator(mode="after")
    def _sequence_splits_over_tensor_ranks(self) -> TrainerSpec:
        if not self.sequence_parallel:
            return self
        if self.tensor_parallel == 1:
            raise ValueError(
                "trainer.sequence_parallel splits the sequence over the tensor-parallel ranks: set "
                "trainer.tensor_parallel above 1, or drop it"
            )
        refuse_unbuilt(
            "trainer.sequence_parallel is built for one stage of fp32 or bf16 parameters",
            {
                "trainer.pipeline_parallel 1": self.pipeline_parallel > 1,
                "trainer.expert_parallel 1": self.expert_parallel > 1,
                "trainer.dtype fp32 or bf16": self.dtype is Precision.BF16_PARAMS,
            },
        )
        return self

    @model_validator(mode="after")
    def _samples_split_over_context_ranks(self) -> TrainerSpec:
        if self.context_parallel == 1:
            return self
        refuse_unbuilt(
            "trainer.context_parallel is built for packed micro-batches of fp32 or bf16 parameters",
            {
                "trainer.packing true": not self.packing,
                "trainer.expert_parallel 1": self.expert_parallel > 1,
                "trainer.dtype fp32 or bf16": self.dtype is Precision.BF16_PARAMS,
            },
        )
        return self

    @model_validator(mode="after")
    def _local_attention_pads(self) -> TrainerSpec:
        if self.attention is Attention.LOCAL and self.packing:
            raise ValueError(
                "trainer.attention local takes padded micro-batches only: set trainer.packing false, or "
                "trainer.attention sdpa"
            )
        return self

    @model_validator(mode="after")
    def _micro_fits(self) -> TrainerSpec:
        # With a token budget micro_batch_size is unused: the budget cuts the micro-batches.
        if self.max_tokens_per_micro_batch is None and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size}), or set max_tokens_per_micro_batch"
            )
        return self


def refuse_unbuilt(built_for: str, clashes: dict[str, bool]) -> None:
    """Refuse the settings ``clashes`` marks True (each named by what to set instead)."""
    needs = ", ".join(setting for setting, clash in clashes.items() if clash)
    if needs:
        raise ValueError(f"{built_for}: set {needs}")
