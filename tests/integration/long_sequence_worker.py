"""The trainer's long-sequence paths against their references, in one replica, started by
test_long_sequences.py.

    python -m tests.integration.long_sequence_worker OUT_DIR TP PP [MOE_SPEC]   (RANK, WORLD_SIZE=TP x PP, MASTER_* set)

On the tiny model (fp32, CPU), each figure the largest absolute difference, or for gradients the largest
relative to the tensor's largest entry:

- ``attention`` (PP=1): torch's fused attention against megatron's local one: the logits, and the
  gradients of a loss over them;
- ``packing``: a trainer on packed micro-batches against one on padded ones, the same weights and rollout
  (samples of many lengths, micro-batches cut by a token budget): the old policy's log probs, the first
  step's loss and every gradient; with MOE_SPEC (a job spec whose policy is a small mixture of
  experts) the same for it, under ``packing_moe``;
- ``chunks`` (PP=1): log probs and entropy scored a few positions at a time against all at once, values
  and gradients, and the final norm's gradient of their sum (``final_norm_grad``), to compare across TP;
- ``recompute``: each ``trainer.recompute`` value against none: the first step's loss and gradients.

Rank 0 writes OUT_DIR/result.json. The quorum is ``FakeSoloQuorum``: one replica, every step committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch
from megatron.core import parallel_state

from checkpoints.rollout_log import RolloutBatch
from elastic_rl.model.gpt import ModelOptions, decoder_states, forward_gpt, init_model_parallel
from elastic_rl.model.packing import packed_input
from elastic_rl.model.source import ModelSource
from elastic_rl.model.token_scores import Entropy, token_scores
from elastic_rl.model.vocab_parallel import gather_logits
from elastic_rl.spec.loading import load_spec
from elastic_rl.spec.trainer import Attention, Recompute
from tests.processes import SPEC
from tests.trainer_doubles import rollout_batch, solo_replica

SAMPLES, WIDTH = 16, 40
COMMON = [
    "rollout.prompts_per_rollout=2",
    "rollout.n_samples_per_prompt=8",
    "trainer.global_batch_size=16",
    "trainer.max_tokens_per_micro_batch=160",
    "algorithm.entropy_coef=0.01",
]


def rollout(vocab: int) -> RolloutBatch:
    """Samples from a few tokens to the whole width: packing and padding differ most."""
    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(2, 8, (SAMPLES,), generator=generator)
    responses = torch.randint(1, WIDTH - 8, (SAMPLES,), generator=generator)
    return rollout_batch(torch.randint(4, vocab, (SAMPLES, WIDTH), generator=generator), prompts, responses, generator)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def first_step(spec_path: Path, overrides: list[str], initial: dict | None = None) -> dict:
    """One replica's old log probs, first step's loss and gradients on the rollout, from ``initial`` (None:
    the weights the seed or the checkpoint gives, returned as ``initial`` for the next run)."""
    spec = load_spec(spec_path, [*COMMON, *overrides])
    source = ModelSource.from_spec(spec.model)
    model = source.build_policy(ModelOptions.of(spec.trainer))
    if initial is None:
        initial = {
            name: tensor.clone() if torch.is_tensor(tensor) else tensor for name, tensor in model.state_dict().items()
        }
    else:
        model.load_state_dict(initial)
    trainer, _ = solo_replica(spec, model)
    batch = rollout(len(source.tokenizer))
    context = trainer.prepare(0, batch)
    assert trainer.step(context, 0).committed
    return {
        "initial": initial,
        # The response tokens': a padded micro-batch also scores prompt and padding positions, never read.
        "old_logp": context.old_logp * batch.loss_mask,
        "loss": context.metrics.values["loss"][0],
        "grads": gradients(model),
    }


def compare(one: dict, other: dict) -> dict[str, float]:
    return {
        "old_logp": (one["old_logp"] - other["old_logp"]).abs().max().item(),
        "loss": abs(one["loss"] - other["loss"]) / abs(other["loss"]),
        "grads": max(relative(a, b) for a, b in zip(one["grads"], other["grads"])),
    }


def loss_of(model: torch.nn.Module, batch: RolloutBatch, budget: int | None = None) -> torch.Tensor:
    """Log probs and entropy of the rollout's response tokens, packed, through ``token_scores``."""
    lengths = batch.prompt_lengths + batch.response_lengths
    item = packed_input(batch.tokens, batch.prompt_lengths, lengths)
    scored = {"budget_bytes": budget} if budget is not None else {}
    logp, ent = token_scores(model, decoder_states(model, item), item.targets, 0.9, Entropy.LOSS, **scored)
    return torch.cat([logp, 0.1 * ent], dim=1)


def attention_and_chunks(layout: list[str]) -> dict[str, float]:
    spec = load_spec(SPEC, [*COMMON, *layout])
    source = ModelSource.from_spec(spec.model)
    fused = source.build_policy(ModelOptions(attention=Attention.SDPA))
    local = source.build_policy(ModelOptions(attention=Attention.LOCAL))
    local.load_state_dict(fused.state_dict())
    batch = rollout(len(source.tokenizer))
    tokens = batch.tokens[:, :-1]
    results, logits, grads = {}, {}, {}
    for name, model in (("fused", fused), ("local", local)):
        shard = forward_gpt(model, tokens)
        (shard.float().pow(2).mean()).backward()
        logits[name], grads[name] = gather_logits(shard.detach()), gradients(model)
    results["attention_logits"] = (logits["fused"] - logits["local"]).abs().max().item()
    results["attention_grads"] = max(relative(a, b) for a, b in zip(grads["fused"], grads["local"]))

    scores = {}
    for name, budget in (("whole", None), ("chunked", 7 * fused.output_layer.weight.shape[0] * 4)):
        fused.zero_grad()
        values = loss_of(fused, batch, budget)
        values.sum().backward()
        scores[name] = values.detach(), gradients(fused)
    results["chunks_values"] = (scores["chunked"][0] - scores["whole"][0]).abs().max().item()
    results["chunks_grads"] = max(relative(a, b) for a, b in zip(scores["chunked"][1], scores["whole"][1]))
    # The final norm is whole on every rank: its gradient is the same at any tensor-parallel size.
    norm = [name for name, _ in fused.named_parameters()].index("decoder.final_layernorm.weight")
    results["final_norm_grad"] = scores["whole"][1][norm].tolist()
    return results


def main() -> None:
    out, tp, pp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    moe_spec = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    torch.use_deterministic_algorithms(True)
    init_model_parallel(tp, seed=7, pipeline_parallel=pp)
    layout = [f"trainer.tensor_parallel={tp}", f"trainer.pipeline_parallel={pp}"]
    results: dict[str, dict[str, float]] = {}
    if pp == 1:
        results["attention_and_chunks"] = attention_and_chunks(layout)

    # The defaults: packed micro-batches, fused attention, nothing recomputed.
    default = first_step(SPEC, layout)
    padded = first_step(SPEC, [*layout, "trainer.packing=false"], default["initial"])
    results["packing"] = compare(default, padded)
    for recompute in (Recompute.SELECTIVE, Recompute.FULL):
        again = first_step(SPEC, [*layout, f"trainer.recompute={recompute.value}"], default["initial"])
        results[f"recompute_{recompute.value}"] = compare(default, again)
    if moe_spec is not None:
        moe_packed = first_step(moe_spec, layout)
        moe_padded = first_step(moe_spec, [*layout, "trainer.packing=false"], moe_packed["initial"])
        results["packing_moe"] = compare(moe_packed, moe_padded)
    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_bytes(orjson.dumps(results))
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
