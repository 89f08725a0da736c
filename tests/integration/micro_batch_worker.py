"""The trainer's gradient under several micro-batch groupings, started by test_micro_batch_gradient.py.

    python -m tests.integration.micro_batch_worker OUT_FILE   (RANK, WORLD_SIZE, MASTER_* set)

Builds the tiny model at TP=1, makes a rollout batch of samples of very different lengths, and
for each loss aggregation computes the policy trainer's gradient over the whole batch: in one
micro-batch, in fixed micro-batches of 3, and by token budgets of 40 and 120 token slots. Writes
each gradient's largest difference from the one-micro-batch gradient, relative to its largest entry.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch

from checkpoints.rollout_log import RolloutBatch
from elastic_rl.model.gpt import destroy_model_parallel, init_model_parallel
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.loading import load_spec
from elastic_rl.trainer.grpo import GrpoTrainer
from tests.processes import SPEC
from tests.trainer_doubles import rollout_batch

SAMPLES, WIDTH = 12, 24
GROUPINGS = {
    "fixed_3": ["trainer.micro_batch_size=3"],
    "budget_40": ["trainer.max_tokens_per_micro_batch=40"],
    "budget_120": ["trainer.max_tokens_per_micro_batch=120"],
}


def varied_batch(vocab: int) -> RolloutBatch:
    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(1, 4, (SAMPLES,), generator=generator)
    responses = torch.randint(1, WIDTH - 4, (SAMPLES,), generator=generator)
    tokens = torch.randint(4, vocab, (SAMPLES, WIDTH), generator=generator)
    positions = torch.arange(WIDTH).unsqueeze(0)
    tokens[positions >= (prompts + responses).unsqueeze(1)] = 0
    return rollout_batch(tokens, prompts, responses, generator)


def gradient(trainer: GrpoTrainer, context, parameters) -> torch.Tensor:
    for param in parameters:
        param.grad = None
    rows = torch.arange(SAMPLES)
    trainer._shard_loss(context, rows, int(context.mask.sum()), SAMPLES, backward=True)
    return torch.cat([param.grad.reshape(-1) for param in parameters])


def main() -> None:
    out = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    init_model_parallel(1, seed=7)
    results = {}
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        common = [
            "rollout.n_samples_per_prompt=4",
            "rollout.prompts_per_rollout=3",
            f"trainer.global_batch_size={SAMPLES}",
            f"trainer.micro_batch_size={SAMPLES}",
            f"algorithm.loss_aggregation={aggregation}",
        ]
        whole = load_spec(SPEC, common)
        source = ModelSource.from_spec(whole.model)
        model = source.build_policy()
        parameters = [p for p in model.parameters() if p.requires_grad]
        batch = varied_batch(len(source.tokenizer))
        reference = GrpoTrainer(whole, model, None, None, None, replica=0)
        context = reference.prepare(0, batch)
        expected = gradient(reference, context, parameters)
        for name, overrides in GROUPINGS.items():
            trainer = GrpoTrainer(load_spec(SPEC, [*common, *overrides]), model, None, None, None, replica=0)
            got = gradient(trainer, context, parameters)
            results[f"{aggregation}/{name}"] = ((got - expected).abs().max() / expected.abs().max()).item()
    out.write_bytes(orjson.dumps(results))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
