"""The log prob and entropy of scored tokens, from the policy's final hidden states: the output layer and the
log-softmax over the vocabulary, vocabulary-parallel at TP > 1.

The whole logits of a long sequence do not fit: 16k scored positions of a
128k-token vocabulary are 8 GiB in fp32, and the softmax makes more copies. While
the logits of a pass would stay within ``LOGITS_BUDGET_BYTES`` they are computed
whole, as megatron's output layer would (autograd keeps them for the backward
pass). Past it, ``ChunkedScores`` computes them a chunk of positions at a time
and keeps only the hidden states, each position's normaliser and its entropy;
its backward pass computes each chunk's logits again. Peak memory is then that
of one chunk's logits, at the cost of the output layer's matrix product once
more.
"""

from __future__ import annotations

import contextlib
from enum import Enum

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from elastic_rl.model.vocab_parallel import entropy_of, log_probs_and_normaliser, normaliser, picked, shard_bounds
from policies.memory import LOGITS_BUDGET_BYTES

ENTROPY_ROWS = 256
"""Positions the entropy metric takes at a time."""


class Entropy(Enum):
    """What a pass needs of the entropy: each costs a pass over the vocabulary-wide logits."""

    NONE = "none"
    """Not computed (the old-policy and reference passes)."""
    METRIC = "metric"
    """Reported: computed without a gradient."""
    LOSS = "loss"
    """In the loss (an entropy bonus): with its gradient."""


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The output layer's weight, this rank's rows of the vocabulary (the embedding's, when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def token_scores(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: Entropy,
    budget_bytes: int = LOGITS_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p of each target, the entropy at each position or None with ``Entropy.NONE``), fp32,
    ``[batch, positions]`` as ``targets``. ``hidden``: the final hidden states of the scored positions,
    ``[batch, positions, hidden]``, from the model's last stage."""
    weight = output_weight(model)
    # As megatron's column-parallel output layer: the backward pass sums the input's gradient over the
    # tensor-parallel ranks, each of which scored its slice of the vocabulary. With sequence parallelism
    # the gather of the sequence (``gpt.decoder_states``) does that.
    if not model.config.sequence_parallel:
        hidden = copy_to_tensor_model_parallel_region(hidden)
    flat, flat_targets = hidden.flatten(0, 1), targets.flatten().to(hidden.device)
    chunk = max(1, budget_bytes // (weight.shape[0] * 4))
    with_gradient = entropy is Entropy.LOSS and torch.is_grad_enabled()
    if flat.shape[0] <= chunk:
        logp, ent = scores_of_logits(output_logits(model, flat), flat_targets, temperature, entropy)
    else:
        logp, ent = ChunkedScores.apply(
            flat, weight, flat_targets, temperature, chunk, entropy is not Entropy.NONE, with_gradient, _autocast(model)
        )
        if entropy is Entropy.NONE:
            ent = None
    shape = targets.shape
    return logp.view(shape), None if ent is None else ent.view(shape)


def output_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The output layer on final hidden states: this rank's logits ``[..., vocab/tp]``, in the precision the
    model computes in. The input is taken as it is (see ``token_scores`` for the tensor-parallel gradient)."""
    with _compute_precision(model):
        return F.linear(hidden, output_weight(model))


def scores_of_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: Entropy
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p of each target, entropy or None) from logits ``[..., vocab/tp]`` and targets ``[...]``."""
    # fp32 before the temperature: a bf16 quotient would be rounded to bf16's 8 bits of mantissa.
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logp, shifted, log_z = log_probs_and_normaliser(logits, targets)
        if entropy is Entropy.NONE:
            return logp, None
        with torch.set_grad_enabled(entropy is Entropy.LOSS and torch.is_grad_enabled()):
            return logp, entropy_of(shifted, log_z)
    # The whole vocabulary on this rank: one log-softmax, the only vocabulary-wide tensor kept for the
    # backward pass.
    log_probs = logits.log_softmax(-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy is Entropy.NONE:
        return logp, None
    if entropy is Entropy.LOSS and torch.is_grad_enabled():
        return logp, -(log_probs.exp() * log_probs).sum(-1)
    with torch.no_grad():
        # A metric: a few positions at a time, so that no more vocabulary-wide tensors are alive at once.
        flat = log_probs.detach().flatten(0, -2)
        ent = torch.cat([-(rows.exp() * rows).sum(-1) for rows in flat.split(ENTROPY_ROWS)])
    return logp, ent.view(logp.shape)


def _autocast(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype megatron's autocast computes the model's matrix products in; None: the parameters'."""
    return model.config.autocast_dtype if model.config.enable_autocast else None


def _compute_precision(model: torch.nn.Module):
    dtype = _autocast(model)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(output_weight(model).device.type, dtype=dtype)


class ChunkedScores(torch.autograd.Function):
    """``scores_of_logits(hidden @ weight.T)``, a chunk of positions at a time, its backward pass computing each
    chunk's logits again. Inputs ``[positions, hidden]`` and this rank's ``[vocab/tp, hidden]`` weight."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, entropy_gradient, autocast_dtype):
        compute = autocast_dtype or weight.dtype
        scale = temperature if temperature > 0 else 1.0
        logp, maxima, log_z, ent = [], [], [], []
        computed_weight = weight.to(compute)  # cast once, not a vocabulary-wide copy per chunk
        for start in range(0, hidden.shape[0], chunk):
            logits = _chunk_logits(hidden[start : start + chunk], computed_weight, compute, scale)
            shifted, chunk_log_z, chunk_max = normaliser(logits)
            logp.append(picked(shifted, targets[start : start + chunk]) - chunk_log_z)
            maxima.append(chunk_max)
            log_z.append(chunk_log_z)
            if with_entropy:
                ent.append(entropy_of(shifted, chunk_log_z))
        logp = torch.cat(logp)
        ent = torch.cat(ent) if with_entropy else logp.new_zeros(logp.shape)
        ctx.save_for_backward(hidden, weight, targets, torch.cat(maxima), torch.cat(log_z), ent)
        ctx.chunk, ctx.scale, ctx.compute = chunk, scale, compute
        if not entropy_gradient:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, maxima, log_z, ent = ctx.saved_tensors
        chunk, scale, compute = ctx.chunk, ctx.scale, ctx.compute
        start_vocab, end_vocab = shard_bounds(weight.shape[0])
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        computed_weight = weight.to(compute)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            piece = hidden[start:end]
            shifted = _chunk_logits(piece, computed_weight, compute, scale) - maxima[start:end, None]
            log_p = shifted - log_z[start:end, None]
            probs = log_p.exp()
            # d logp(target) / d z = onehot(target) - p; d entropy / d z = -p (log p + entropy), z = logits / T.
            grad = -probs * grad_logp[start:end, None]
            if grad_ent is not None:
                grad -= probs * (log_p + ent[start:end, None]) * grad_ent[start:end, None]
            local = targets[start:end]
            mine = (local >= start_vocab) & (local < end_vocab)
            rows = mine.nonzero().squeeze(1)
            grad[rows, local[rows] - start_vocab] += grad_logp[start:end][rows]
            grad = (grad / scale).to(compute)
            grad_hidden[start:end] = (grad @ computed_weight).to(hidden.dtype)
            grad_weight += (grad.t() @ piece.to(compute)).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, compute: torch.dtype, scale: float) -> torch.Tensor:
    """fp32 logits of a chunk of positions, over the temperature, from products in ``compute`` precision
    (``weight`` is in it already)."""
    return F.linear(hidden.to(compute), weight).float() / scale
