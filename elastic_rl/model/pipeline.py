"""Runs a step's micro-batches through the policy: on one stage in turn, or through megatron's pipeline schedule.

The trainer gives each micro-batch's input (``model.packing``: padded or packed)
and a ``score``, which turns the final hidden states of the positions the
micro-batch scores into its loss (``model.token_scores`` gives their log
probabilities; it keeps what else it needs of them: metric sums). On one stage each micro-batch's backward pass
follows its forward pass. With pipeline stages, megatron-core's own schedule
runs them (``get_forward_backward_func``: one forward, one backward, the
activations and their gradients sent between stages), ``score`` runs on the
last stage only, and a tied embedding's two copies, on the first and last
stage, have their gradients summed afterwards (megatron does that in
``finalize_model_grads`` for its DDP wrapper, which the trainer does not use).
On a CPU slot the schedule runs inside ``cpu_shim.cuda_calls_on_cpu``.

With sequence parallelism (``trainer.sequence_parallel``) a micro-batch's
sequence is padded at its end to a multiple of the tensor-parallel ranks, so
that it splits evenly over them (one split over context-parallel ranks is one
already: ``ModelInput.split_over_context`` made it so).

With expert parallelism each layer's token dispatcher gathers the tokens of
every expert-parallel rank, tensors of one shape each, once per micro-batch.
Those ranks hold different samples, so before a pass they agree on the
micro-batches: as many on each, each padded to the largest rows and width of
its number (right padding: a causal model's real positions do not see it;
packed, the added tokens are a sample of their own), and a rank with fewer runs
empty ones that add nothing to its loss. ``score`` sees its own micro-batch's
scored positions only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from elastic_rl.model.cpu_shim import cuda_calls_on_cpu
from elastic_rl.model.gpt import decoder_states, model_device
from elastic_rl.model.packing import ModelInput, empty_input

Score = Callable[[int, torch.Tensor], torch.Tensor]
"""(micro-batch index, the final hidden states of its scored positions ``[batch, scored, hidden]``) -> its
loss."""


def stages() -> int:
    return parallel_state.get_pipeline_model_parallel_world_size()


def run_micro_batches(model: torch.nn.Module, inputs: list[ModelInput], score: Score, backward: bool) -> None:
    """Every micro-batch forward (and, with ``backward``, backward: gradients add up in ``.grad``)."""
    inputs, score = _same_shapes_over_expert_ranks(inputs, score)
    inputs, score = _sequences_split_evenly(model, inputs, score)
    on_cpu = model_device(model).type == "cpu"
    if stages() == 1:
        # megatron's sequence-parallel linear layers ask CUDA where to put their gathered inputs.
        with cuda_calls_on_cpu() if on_cpu and model.config.sequence_parallel else contextlib.nullcontext():
            for index, item in enumerate(inputs):
                loss = score(index, decoder_states(model, item))
                if backward:
                    loss.backward()
        return
    last = parallel_state.is_pipeline_last_stage()

    def forward_step(numbered, stage):
        index, item = next(numbered)
        # Only the last stage's output is scored; the others pass on every position's activations.
        return decoder_states(stage, item, last_stage=last), functools.partial(scored, index)

    def scored(index, hidden):
        # (loss, tokens, reported): the loss is normalised by the trainer; megatron only counts the tokens.
        return score(index, hidden), torch.tensor(1, dtype=torch.int), {}

    schedule = get_forward_backward_func()
    with cuda_calls_on_cpu() if on_cpu else contextlib.nullcontext():
        schedule(
            forward_step_func=forward_step,
            data_iterator=iter(enumerate(inputs)),
            model=model,
            num_microbatches=len(inputs),
            # The stages send each activation's shape ahead of it (variable_seq_lengths); these are bounds.
            seq_length=max(item.tokens.shape[1] for item in inputs),
            micro_batch_size=max(item.tokens.shape[0] for item in inputs),
            forward_only=not backward,
        )
    if backward:
        _sum_tied_embedding_gradients(model)


def micro_batches_over_expert_ranks(count: int) -> int:
    """How many micro-batches a pass of ``count`` here runs: the most any expert-parallel rank has."""
    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return count
    counts: list[int] = [0] * parallel_state.get_expert_model_parallel_world_size()
    torch.distributed.all_gather_object(counts, count, group=parallel_state.get_expert_model_parallel_group())
    return max(counts)


def _sequences_split_evenly(model: torch.nn.Module, inputs: list[ModelInput], score: Score):
    """With sequence parallelism each micro-batch's sequence splits evenly over the tensor-parallel ranks: it
    is padded at its end to a multiple of them (a causal model's real positions do not see it; packed,
    the added tokens are a sample of their own); ``score`` sees its own scored positions only."""
    ranks = parallel_state.get_tensor_model_parallel_world_size()
    if not model.config.sequence_parallel or ranks == 1:
        return inputs, score
    padded = [item.padded_to(item.tokens.shape[0], -(-item.tokens.shape[1] // ranks) * ranks) for item in inputs]

    def own_score(index: int, hidden: torch.Tensor) -> torch.Tensor:
        rows, scored = inputs[index].targets.shape
        return score(index, hidden[:rows, :scored])

    return padded, own_score


def _same_shapes_over_expert_ranks(inputs: list[ModelInput], score: Score) -> tuple[list[ModelInput], Score]:
    """``inputs`` padded, and empty ones added, to the micro-batches every expert-parallel rank agrees on;
    ``score`` for them (the empty ones' loss is 0)."""
    ranks = parallel_state.get_expert_model_parallel_world_size()
    if ranks == 1:
        return inputs, score
    shapes: list[list[tuple[int, int]]] = [[]] * ranks
    own = [tuple(item.tokens.shape) for item in inputs]
    torch.distributed.all_gather_object(shapes, own, group=parallel_state.get_expert_model_parallel_group())
    agreed = [
        tuple(max(rank_shapes[index][dim] for rank_shapes in shapes if index < len(rank_shapes)) for dim in (0, 1))
        for index in range(max(len(rank_shapes) for rank_shapes in shapes))
    ]
    packed = inputs[0].packed if inputs else False
    padded = [
        inputs[index].padded_to(rows, seq) if index < len(inputs) else empty_input(rows, seq, packed)
        for index, (rows, seq) in enumerate(agreed)
    ]

    def own_score(index: int, hidden: torch.Tensor) -> torch.Tensor:
        if index >= len(inputs):
            return hidden.sum() * 0.0  # its backward still runs the dispatcher's collectives
        rows, scored = inputs[index].targets.shape
        return score(index, hidden[:rows, :scored])

    return padded, own_score


def _sum_tied_embedding_gradients(model: torch.nn.Module) -> None:
    if model.share_embeddings_and_output_weights and parallel_state.is_rank_in_embedding_group():
        weight = model.shared_embedding_or_output_weight()
        torch.distributed.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def largest_over_stages(value: float, device: torch.device) -> float:
    """The largest of each stage's ``value`` (the last stage's, where only it measured one)."""
    if stages() == 1:
        return value
    largest = torch.tensor([value], device=device)
    group = parallel_state.get_pipeline_model_parallel_group()
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=group)
    return largest.item()


def sum_over_stages(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over this rank's pipeline stages (what only the last stage computed, or every stage's count)."""
    if stages() > 1:
        torch.distributed.all_reduce(tensor, group=parallel_state.get_pipeline_model_parallel_group())
