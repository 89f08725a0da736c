"""How many bytes one trainer rank holds, for a model and a replica layout: what `erl plan` prints and
what `erl submit` checks against the memory of a node's slots.

Pure. Parameters are counted exactly as megatron-core's GPTModel lays them out (the local layer spec:
column-parallel weights split by output rows, row-parallel ones by input columns, the vocabulary split
across tensor-parallel ranks, norms replicated), so the count equals the built model's on every rank.
A pipeline stage holds its share of the layers (the first ones take the remainder), the first stage the
embedding and the last the output layer, both with tied embeddings. The rank accounted is the stage
that holds the most, activations included.

Bytes per parameter come from the ``Precision`` the trainer uses: fp32 parameters, fp32 gradients and
AdamW's two fp32 moments (16 bytes a parameter in fp32 and bf16, which is autocast over fp32
parameters), the moments whole on every rank or sharded over the replica's data-parallel ranks (an even
split: torch's ZeroRedundancyOptimizer splits by whole tensors, so a rank may hold one tensor's moments
more). ``MEGATRON_BF16`` is ``trainer.dtype: bf16-params``, megatron's bf16 training with its
distributed optimizer (bf16 parameters, fp32 gradients, fp32 main weights and moments sharded over
data-parallel ranks; GPU slots only).

With ``trainer.optimizer_offload`` the optimizer's state is counted in the rank's host memory instead
(``RankMemory.host_bytes``), with the two buffers its step copies a parameter and its gradient through.

Activations are an estimate, stated so it can be checked (docs/benchmarks/memory.md compares it with measured
peaks): micro-batches of ``tokens`` tokens (packed: the samples' own; padded: samples times the
longest), every layer's saved tensors at once as the recomputation leaves them (``Kept``), with
attention's saved state (the fused kernel's output and normaliser, or unfused attention's score and
probability matrices, which grow with the sequence), as many micro-batches as a pipeline stage keeps in
flight, and the output layer's logits three times over in fp32 (the logits, their log-softmax and its
gradient), at most a chunk of them where the scoring computes them in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

MIB = 1024**2
GIB = 1024**3
FP32_BYTES = 4
# Per token and layer, in elements of the compute dtype: the tensors a transformer layer keeps for its
# backward pass, in units of the hidden size (the two norms' inputs and outputs, the attention and MLP
# inputs, the residual adds), of the query/key/value width (q, k and v before and after rotary), and of
# the MLP's inner width (fc1's gate and up outputs, which megatron's fused SwiGLU keeps as its only input,
# and the SwiGLU product, fc2's input).
HIDDEN_COPIES = 8
QKV_COPIES = 2
FFN_COPIES = 3
# Unfused attention: the scores, their masked copy and the softmax's output are alive together at the
# softmax (the probabilities stay for the backward pass), per token, per head, per key position.
ATTENTION_MATRICES = 3
LOGIT_COPIES = 3
LOGITS_BUDGET_BYTES = 1 << 30
"""Most bytes the trainer's fp32 logits of one pass (scored positions x its share of the vocabulary x 4)
take before it computes them in chunks of positions of at most this size (``model.token_scores``): 1 GiB,
2,048 positions of a 128k vocabulary at TP=1."""
# Selective recomputation keeps, per token and layer, the norms' inputs and outputs and the residual sums
# (hidden-sized), q, k and v once, and the attention's output; the core attention and the dense MLP are
# computed again from their inputs.
SELECTIVE_HIDDEN_COPIES = 6


class Kept(Enum):
    """What a layer keeps for its backward pass (``trainer.recompute``)."""

    ALL = "none"
    """Every activation: nothing computed again."""
    SELECTIVE = "selective"
    """Megatron's selective recomputation: the core attention and the dense MLP are computed again."""
    INPUTS = "full"
    """Megatron's full recomputation: each layer's input only; the layer runs again in the backward pass."""


@dataclass(frozen=True)
class ActivationLayout:
    """How the trainer's passes hold their activations."""

    fused_attention: bool = True
    """torch's fused kernel: no ``[heads, seq, seq]`` matrices (``trainer.attention: sdpa``)."""
    kept: Kept = Kept.ALL
    logits_cap_bytes: int | None = None
    """The most fp32 logits the scoring holds at once (it computes them in chunks past it); None: all."""
    sequence_parallel: bool = False
    """megatron's sequence parallelism: the hidden-sized tensors a layer keeps (its norms' inputs and
    outputs, the residual sums, its input) are split along the sequence over the tensor-parallel ranks."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a Llama-family model's parameters and activations."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    """The MLP's inner width; in a mixture of experts, each expert's."""
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    """A mixture of experts' MLPs per layer (and its router's outputs); 0: one dense MLP."""
    experts_per_token: int = 0


@dataclass(frozen=True)
class Layout:
    """One replica's ranks: tensor- times pipeline- times data-parallel, a mixture of experts' experts
    split over ``expert_parallel`` of the data-parallel ranks."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    """Ranks each sample's tokens are split over (each holds 1/context_parallel of every micro-batch)."""

    @property
    def ranks(self) -> int:
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel * self.data_parallel

    def __str__(self) -> str:
        context = f" CP={self.context_parallel}" if self.context_parallel > 1 else ""
        experts = f" EP={self.expert_parallel}" if self.expert_parallel > 1 else ""
        return f"TP={self.tensor_parallel}{context} PP={self.pipeline_parallel} DP={self.data_parallel}{experts}"


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of state, and whether the optimizer's is sharded."""

    name: str
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    """Adam's moments plus any main (master) copy of the weights."""
    optimizer_sharded: bool
    """Split over the replica's data-parallel ranks (a distributed optimizer)."""
    activation_bytes: int
    """Per saved activation element (logits are fp32 either way)."""


FP32_WHOLE = Precision("fp32 parameters, whole AdamW", FP32_BYTES, FP32_BYTES, 2 * FP32_BYTES, False, FP32_BYTES)
"""This trainer, fp32 or bf16 autocast (bf16 matmul outputs; counted as fp32 to stay on the safe side)."""
FP32_SHARDED = Precision(
    "fp32 parameters, AdamW sharded over DP", FP32_BYTES, FP32_BYTES, 2 * FP32_BYTES, True, FP32_BYTES
)
"""This trainer with ``trainer.shard_optimizer`` at ``trainer.data_parallel`` > 1 (ZeRO's first stage)."""
MEGATRON_BF16 = Precision("bf16 parameters, distributed optimizer", 2, FP32_BYTES, 3 * FP32_BYTES, True, FP32_BYTES)
"""``trainer.dtype: bf16-params``, megatron's bf16 training: bf16 parameters, fp32 gradients (megatron's
data-parallel buffers, which the replicas sum), fp32 main weights and moments sharded over data-parallel
ranks. Activations counted as fp32: on an H100 a step of the wider toy model peaked 9 % above an estimate
at 2 bytes an element (its attention takes the softmax in fp32)."""


@dataclass(frozen=True)
class RankMemory:
    """What one rank of a replica holds, in bytes."""

    parameters: int
    """Its parameters (its share of the model), counted, not estimated."""
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    frozen_bytes: int
    """The frozen models (the KL reference, a distillation teacher), in the parameters' dtype; 0 without."""
    activation_bytes: int
    host_bytes: int = 0
    """Host memory the rank holds for its optimizer (``trainer.optimizer_offload``: AdamW's moments and the
    step's two copy buffers); its ``optimizer_bytes`` on the device are then 0."""
    critic_bytes: int = 0
    """PPO's critic, held beside the policy at its layout: its weights, gradients and (unless offloaded)
    optimizer state. Its passes follow the policy's, so its activations add nothing to their peak."""

    @property
    def total(self) -> int:
        """The bytes on the rank's device."""
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.optimizer_bytes
            + self.frozen_bytes
            + self.activation_bytes
            + self.critic_bytes
        )


def layers_per_stage(num_layers: int, pipeline_parallel: int) -> list[int]:
    """How many transformer layers each pipeline stage holds; the first stages take the remainder."""
    base, extra = divmod(num_layers, pipeline_parallel)
    return [base + (1 if stage < extra else 0) for stage in range(pipeline_parallel)]


def layer_parameters(shape: ModelShape, tensor_parallel: int, expert_parallel: int = 1) -> int:
    """One transformer layer's parameters on one tensor-parallel rank (holding its share of the experts)."""
    hidden, head_dim = shape.hidden_size, shape.head_dim
    qkv_rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * head_dim
    attention_width = shape.num_attention_heads * head_dim
    mlps = shape.experts // expert_parallel if shape.experts else 1
    split = (
        qkv_rows * hidden  # linear_qkv, column-parallel
        + (qkv_rows if shape.qkv_bias else 0)
        + hidden * attention_width  # linear_proj, row-parallel
        + mlps * 2 * shape.ffn_hidden_size * hidden  # each MLP's linear_fc1 (gate and up), column-parallel
        + mlps * hidden * shape.ffn_hidden_size  # linear_fc2, row-parallel
    ) // tensor_parallel
    replicated = 2 * hidden + (2 * head_dim if shape.qk_norm else 0)  # input and pre-MLP norms, q/k norms
    router = hidden * shape.experts
    return split + replicated + router


def largest_tensor(shape: ModelShape, tensor_parallel: int) -> int:
    """The most elements one parameter tensor of a rank can have: its share of the embedding (or output
    layer), of a layer's query/key/value, output projection or MLP matrices, or a router."""
    qkv_rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.head_dim
    attention_width = shape.num_attention_heads * shape.head_dim
    hidden = shape.hidden_size
    return max(
        shape.vocab_size * hidden // tensor_parallel,
        qkv_rows * hidden // tensor_parallel,
        attention_width * hidden // tensor_parallel,
        2 * shape.ffn_hidden_size * hidden // tensor_parallel,
        hidden * shape.experts,
    )


def stage_parameters(shape: ModelShape, layout: Layout) -> list[int]:
    """Each pipeline stage's parameters on one of its tensor-parallel ranks."""
    embedding = shape.vocab_size * shape.hidden_size // layout.tensor_parallel
    stages = layout.pipeline_parallel
    counts = []
    for stage, layers in enumerate(layers_per_stage(shape.num_layers, stages)):
        count = layers * layer_parameters(shape, layout.tensor_parallel, layout.expert_parallel)
        first, last = stage == 0, stage == stages - 1
        if first:
            count += embedding
        if last:
            count += shape.hidden_size  # the final norm
            # The output layer; with tied embeddings the last stage holds its own copy of the embedding
            # unless it is also the first.
            if not shape.tie_embeddings or not first:
                count += embedding
        counts.append(count)
    return counts


def activation_bytes(
    shape: ModelShape,
    layout: Layout,
    precision: Precision,
    tokens: int,
    sequence: int,
    stage: int = 0,
    held: ActivationLayout = ActivationLayout(),
) -> int:
    """The stated estimate for pipeline stage ``stage``: micro-batches of ``tokens`` tokens whose longest
    sample has ``sequence`` tokens, held as ``held`` says. Under megatron's one-forward-one-backward
    schedule stage s of p holds p - s micro-batches' activations at its peak; the last stage also holds
    the logits. A recomputing layer adds one layer's whole activations while it runs again. Split over
    context-parallel ranks, a rank holds 1/CP of the tokens, and each layer's attention keeps the keys
    and values it gathered for its two chunks' calls, (2 CP + 1) / 2 times its own tokens' (its masks
    are views of one vector: not counted)."""
    tp, cp = layout.tensor_parallel, layout.context_parallel
    hidden = shape.hidden_size // tp if held.sequence_parallel else shape.hidden_size
    qkv = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.head_dim // tp
    heads = shape.num_attention_heads // tp
    if held.fused_attention:
        attention = heads * shape.head_dim + heads  # the kernel's output and its log-sum-exp
    else:
        attention = ATTENTION_MATRICES * heads * sequence
    ffn = FFN_COPIES * max(shape.experts_per_token, 1) * shape.ffn_hidden_size // tp
    whole_layer = HIDDEN_COPIES * hidden + QKV_COPIES * qkv + ffn + attention
    if cp > 1:
        whole_layer += 2 * shape.num_query_groups * shape.head_dim // tp * (2 * cp + 1) // 2
        tokens = -(-tokens // cp)
    if held.kept is Kept.ALL:
        per_token_layer, again = whole_layer, 0
    elif held.kept is Kept.SELECTIVE:
        per_token_layer, again = SELECTIVE_HIDDEN_COPIES * hidden + qkv + heads * shape.head_dim, whole_layer
    else:
        per_token_layer, again = hidden, whole_layer
    stages = layout.pipeline_parallel
    layers = layers_per_stage(shape.num_layers, stages)[stage]
    in_flight = stages - stage
    kept = tokens * (in_flight * layers * per_token_layer + again) * precision.activation_bytes
    if stage != stages - 1:
        return kept
    logits = tokens * shape.vocab_size // tp * FP32_BYTES
    if held.logits_cap_bytes is not None:
        logits = min(logits, held.logits_cap_bytes)
    return kept + LOGIT_COPIES * logits


def rank_memory(
    shape: ModelShape,
    layout: Layout,
    precision: Precision,
    tokens: int,
    sequence: int,
    frozen_models: int,
    held: ActivationLayout = ActivationLayout(),
    *,
    optimizer_offload: bool = False,
    critic: bool = False,
) -> RankMemory:
    """What the fullest rank of a replica in ``layout`` holds: its stage's parameters, their gradients
    and optimizer state (sharded over data-parallel ranks if the precision says so), the copies of the
    ``frozen_models`` held for their log probs alone (a KL reference, a distillation teacher: the policy's
    architecture), and its micro-batches' activations, held as ``held`` says. With ``optimizer_offload``
    the optimizer's state is in host memory, with two fp32 buffers of the largest tensor for the step's
    copies of a parameter and its gradient. A ``critic`` (PPO's) is one more trained copy of the model: its
    weights, gradients and optimizer state, offloaded with the policy's."""
    optimizer_share = layout.data_parallel if precision.optimizer_sharded else 1
    copy_buffers = 2 * largest_tensor(shape, layout.tensor_parallel) * FP32_BYTES
    ranks = []
    for stage, parameters in enumerate(stage_parameters(shape, layout)):
        optimizer = -(-parameters * precision.optimizer_bytes // optimizer_share)
        trained = parameters * (precision.parameter_bytes + precision.gradient_bytes)
        critic_optimizer = optimizer if critic else 0
        ranks.append(
            RankMemory(
                parameters=parameters,
                parameter_bytes=parameters * precision.parameter_bytes,
                gradient_bytes=parameters * precision.gradient_bytes,
                optimizer_bytes=0 if optimizer_offload else optimizer,
                frozen_bytes=frozen_models * parameters * precision.parameter_bytes,
                activation_bytes=activation_bytes(shape, layout, precision, tokens, sequence, stage, held),
                host_bytes=optimizer + critic_optimizer + copy_buffers if optimizer_offload else 0,
                critic_bytes=trained + (0 if optimizer_offload else critic_optimizer) if critic else 0,
            )
        )
    return max(ranks, key=lambda rank: rank.total)


def host_shortfall(need: int, host_memory: dict[str, tuple[int | None, int]]) -> str | None:
    """Why no node's host memory can hold ``need`` bytes for each of its slots, given each eligible node's
    (host memory, slots); None when one can, or when it cannot be known (as ``slot_shortfall``)."""
    per_slot = {node: None if memory is None else memory // slots for node, (memory, slots) in host_memory.items()}
    if not per_slot or any(share is None or share >= need for share in per_slot.values()):
        return None
    nodes = ", ".join(
        f"{node} {memory / GIB:.1f} GiB over {slots} slots" for node, (memory, slots) in sorted(host_memory.items())
    )
    return f"a trainer rank keeps {need / GIB:.2f} GiB in host memory and no node has that per slot ({nodes})"


def slot_shortfall(need: int, slot_memory: dict[str, int | None]) -> str | None:
    """Why no node can hold a rank needing ``need`` bytes, given each eligible node's memory per slot
    (None where the node does not know it); None when one can, or when it cannot be known: a node of
    unknown memory might, and with no eligible node yet the job waits for one."""
    if not slot_memory or any(memory is None or memory >= need for memory in slot_memory.values()):
        return None
    largest = max(memory for memory in slot_memory.values() if memory is not None)
    nodes = ", ".join(f"{node} {memory / GIB:.1f} GiB" for node, memory in sorted(slot_memory.items()))
    return f"a trainer rank needs {need / GIB:.2f} GiB and the largest slot holds {largest / GIB:.1f} GiB ({nodes})"
