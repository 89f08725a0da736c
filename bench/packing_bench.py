"""Packed micro-batches against padded ones: the trainer's tokens per second on a long-tailed rollout.

    .venv/bin/python bench/packing_bench.py                 # SmolLM2-135M-Instruct (`make models`), about 20 minutes
    .venv/bin/python bench/packing_bench.py --model tiny    # the toy model, seconds

One rollout of 64 samples whose lengths follow a long tail (lognormal: the longest 8 times the median),
trained for one optimizer step of all 64 by the same replica three ways, from the same weights, the
three ways run by turns ``--rounds`` times (time: the median of a way's steps):

- packed: each micro-batch its samples end to end, ``trainer.max_tokens_per_micro_batch`` real tokens;
- padded, ``trainer.micro_batch_size`` samples each, padded to their longest;
- padded by the token budget: samples grouped by length, samples times the longest within the budget.

For each: the step's time and its real tokens per second, the share of the micro-batches' token slots
that is padding, and the step's loss and gradients against the packed step's. The targets: packed at
least 1.5 times padded's tokens per second, and at least 0.9 / (1 - p) times the token budget's, where
p is the token budget's padding share.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from elastic_rl.model.gpt import ModelOptions, init_model_parallel  # noqa: E402
from elastic_rl.model.source import ModelSource  # noqa: E402
from elastic_rl.net import free_port  # noqa: E402
from elastic_rl.spec.loading import load_spec  # noqa: E402
from elastic_rl.trainer.micro_batches import fixed_micro_batches, padding_fraction, token_budget_micro_batches  # noqa: E402
from tests.processes import SPEC  # noqa: E402
from tests.trainer_doubles import rollout_batch, solo_replica  # noqa: E402

SAMPLES = 64
PROMPT = 32
SMOLLM2_SPEC = REPO / "examples" / "smollm2-math.yaml"


def lengths(median: int, generator: torch.Generator) -> torch.Tensor:
    """Sample lengths from a lognormal tail whose longest is 8 times its median: a normal draw, shifted to
    a median of 0 and scaled so that its largest is log 8, then exponentiated."""
    normal = torch.randn(SAMPLES, generator=generator)
    normal = (normal - normal.median()) / (normal.max() - normal.median()) * math.log(8)
    return (normal.exp() * median).round().long().clamp(min=PROMPT + 4)


def step(spec, initial: dict, batch) -> tuple[float, float, list[torch.Tensor]]:
    """One optimizer step of the whole rollout: its seconds, its loss, its gradients."""
    model = ModelSource.from_spec(spec.model).build_policy(ModelOptions.of(spec.trainer))
    model.load_state_dict(initial)
    trainer, _ = solo_replica(spec, model)
    context = trainer.prepare(0, batch)
    started = time.perf_counter()
    assert trainer.step(context, 0).committed
    seconds = time.perf_counter() - started
    return seconds, context.metrics.values["loss"][0], [p.grad.clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--median", type=int, default=96)
    parser.add_argument("--budget", type=int, default=2048, help="trainer.max_tokens_per_micro_batch")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    init_model_parallel(1, seed=0, init_method=f"tcp://127.0.0.1:{free_port()}")
    generator = torch.Generator().manual_seed(0)
    total = lengths(args.median, generator)
    width = int(total.max())
    spec_path, model_settings = (
        (SMOLLM2_SPEC, []) if args.model == "smollm2" else (SPEC, [f"model.max_position_embeddings={width}"])
    )
    common = [
        *model_settings,
        "rollout.prompts_per_rollout=8",
        "rollout.n_samples_per_prompt=8",
        f"trainer.global_batch_size={SAMPLES}",
        "algorithm.kl_coef=0",
        "algorithm.use_rollout_logprobs=true",  # the step alone: no old-policy pass before it
    ]
    source = ModelSource.from_spec(load_spec(spec_path, common).model)
    tokens = torch.randint(4, len(source.tokenizer), (SAMPLES, width), generator=generator)
    batch = rollout_batch(tokens, torch.full((SAMPLES,), PROMPT), total - PROMPT, generator)
    initial = {k: v.clone() if torch.is_tensor(v) else v for k, v in source.build_policy().state_dict().items()}
    rows = torch.arange(SAMPLES)
    ways = {
        "packed, token budget": (["trainer.packing=true", f"trainer.max_tokens_per_micro_batch={args.budget}"], 0.0),
        f"padded, {args.micro_batch_size} samples": (
            ["trainer.packing=false", f"trainer.micro_batch_size={args.micro_batch_size}"],
            padding_fraction(fixed_micro_batches(rows, args.micro_batch_size), total),
        ),
        "padded, token budget": (
            ["trainer.packing=false", f"trainer.max_tokens_per_micro_batch={args.budget}"],
            padding_fraction(token_budget_micro_batches(rows, total, args.budget, packed=False), total),
        ),
    }
    real = int(total.sum())
    print(f"{args.model}: {SAMPLES} samples, {real:,} tokens, median {int(total.median())}, longest {width}")
    print("| micro-batches | padding | step (s) | tokens/s | packed's tokens/s over it | loss, grads vs packed |")
    print("|---|---|---|---|---|---|")
    seconds_of: dict[str, list[float]] = {name: [] for name in ways}
    results = {}
    for _ in range(args.rounds):
        for name, (settings, padding) in ways.items():
            seconds, loss, grads = step(load_spec(spec_path, [*common, *settings]), initial, batch)
            seconds_of[name].append(seconds)
            results[name] = (padding, statistics.median(seconds_of[name]), loss, grads)
    packed_seconds, packed_loss, packed_grads = results["packed, token budget"][1:]
    for name, (padding, seconds, loss, grads) in results.items():
        loss_gap = abs(loss - packed_loss) / abs(packed_loss)
        grad_gap = max(
            ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(grads, packed_grads)
        )
        print(
            f"| {name} | {padding:.1%} | {seconds:.2f} | {real / seconds:.0f} | {seconds / packed_seconds:.2f} | "
            f"{loss_gap:.1e}, {grad_gap:.1e} |"
        )
    budget_padding = results["padded, token budget"][0]
    target = 0.9 / (1 - budget_padding)
    print(
        f"targets: >= 1.5 over padded samples; >= 0.9 / (1 - {budget_padding:.3f}) = {target:.2f} over the token budget"
    )
    assert math.isfinite(packed_loss)


if __name__ == "__main__":
    main()
