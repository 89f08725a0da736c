"""The cpu engine's routing against the trainer's, started by test_routing_replay.py.

    python -m tests.integration.routing_replay_worker OUT PP CHECKPOINT...   (RANK, WORLD_SIZE, MASTER_* set)

For each CHECKPOINT (a small mixture of experts): the cpu engine, in this
process, generates seeded samples of fixed prompts with their log probs and
routing records, as a job's engine would; then the policy built from the
checkpoint in PP pipeline stages scores them, once routing each token itself
and once replaying the engine's routing, padded and packed; and trains on them, replaying, in two
micro-batches with and without full recomputation. The last stage writes
OUT/<name>.json: the largest |trainer - engine| log prob over the response
tokens each way, the share of (token, layer) choices the trainer's routers
would have made as the engine did, the largest difference between the
gradients with and without recomputation (over every stage's parameters),
and, for a rollout of the samples committed to a rollout log and read back,
the largest difference between the weights trained on the rollout as read
back and as committed, and between those and the weights trained on it
without its routing records.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path

import orjson
import torch
import yaml
from megatron.core import parallel_state

from checkpoints.rollout_log import RolloutBatch, read_rollout, write_rollout
from elastic_rl import routing_record as routing
from elastic_rl.architecture import from_hf_config
from elastic_rl.engines.cpu_engine import CpuEngine
from elastic_rl.model.gpt import ModelOptions, destroy_model_parallel, init_model_parallel
from elastic_rl.model.packing import packed_input, padded_input
from elastic_rl.model.pipeline import run_micro_batches
from elastic_rl.model.routing_replay import RoutingReplay
from elastic_rl.model.source import ModelSource
from elastic_rl.model.token_scores import Entropy, token_scores
from elastic_rl.routing_record import RoutingShape
from elastic_rl.spec.loading import load_spec
from elastic_rl.spec.model import ModelSpec
from elastic_rl.spec.trainer import Recompute
from tests.processes import SPEC
from tests.trainer_doubles import solo_replica

PROMPTS, SAMPLES, NEW_TOKENS = 6, 2, 12
TRAINING = [
    f"rollout.prompts_per_rollout={PROMPTS}",
    f"rollout.n_samples_per_prompt={SAMPLES}",
    f"trainer.global_batch_size={PROMPTS * SAMPLES // 2}",
    "trainer.micro_batch_size=3",
    "trainer.lr=0.01",
    "algorithm.routing_replay=true",
]


async def generate(checkpoint: Path) -> list[dict]:
    """Seeded samples of fixed prompts: prompt ids, output ids, log probs and routing record of each."""
    engine = CpuEngine(checkpoint, max_batch_size=PROMPTS * SAMPLES, weight_version="0")
    loop = asyncio.create_task(engine.run())
    prompts = torch.randint(3, engine.vocab_size, (PROMPTS, 6), generator=torch.Generator().manual_seed(0)).tolist()
    requests = [
        engine.make_request(
            {
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "seed": 100 * p + s},
                "return_logprob": True,
                routing.REQUEST_FLAG: True,
            },
            prompts[p],
            None,
        )
        for p in range(PROMPTS)
        for s in range(SAMPLES)
    ]
    answers = await asyncio.gather(*(engine.generate(request) for request in requests))
    loop.cancel()
    shape = RoutingShape.of(from_hf_config(checkpoint))
    return [
        {
            "prompt": request.input_ids,
            "output": answer["output_ids"],
            "logprobs": [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]],
            "routing": routing.decode_wire(answer["meta_info"][routing.WIRE_KEY], shape),
        }
        for request, answer in zip(requests, answers)
    ]


def laid_out(samples: list[dict], shape: routing.RoutingShape):
    """The samples' tokens, engine log probs, response mask, prompt lengths, lengths and replayable routing,
    as a rollout batch holds them."""
    rows = [sample["prompt"] + sample["output"] for sample in samples]
    width = max(map(len, rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    engine = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for index, (row, sample) in enumerate(zip(rows, samples)):
        tokens[index, : len(row)] = torch.tensor(row)
        start = len(sample["prompt"])
        engine[index, start : len(row)] = torch.tensor(sample["logprobs"])
        mask[index, start : len(row)] = 1.0
    prompts = torch.tensor([len(sample["prompt"]) for sample in samples])
    lengths = torch.tensor(list(map(len, rows)))
    stored = routing.stored([sample["routing"] for sample in samples], width, shape)
    return tokens, engine, mask, prompts, lengths, routing.replayable(stored)


@torch.no_grad()
def gaps(checkpoint: Path, samples: list[dict]) -> dict[str, float] | None:
    """The trainer's log-prob gap to the engine without and with replay, and the routing agreement (None
    on a stage before the last)."""
    source = ModelSource.from_spec(ModelSpec(hf_checkpoint=checkpoint))
    model = source.build_policy().eval()
    replay = RoutingReplay.attach(model)
    tokens, engine, mask, prompts, lengths, replayed_routing = laid_out(samples, RoutingShape.of(source.architecture))
    width = tokens.shape[1]
    result = {}
    passes = (("own", padded_input, None), ("replayed", padded_input, replayed_routing))
    for name, lay_out, replayed in (*passes, ("replayed_packed", packed_input, replayed_routing)):
        item = lay_out(tokens, prompts, lengths, replayed)
        logp = []

        def score(_index: int, hidden: torch.Tensor, item=item, logp=logp) -> torch.Tensor:
            scores, _ = token_scores(model, hidden, item.targets, 1.0, Entropy.NONE)
            logp.append(item.spread(scores, width))
            return hidden.new_zeros(())

        with replay.counting_agreement() if name == "replayed" else torch.no_grad():
            run_micro_batches(model, [item], score, backward=False)
        if logp:
            result[f"gap_{name}"] = ((logp[0] - engine).abs() * mask).max().item()
    agreement = replay.take_agreement()
    if not parallel_state.is_pipeline_last_stage():
        return None
    return {**result, "agreement": agreement}


def recompute_gradient_gap(checkpoint: Path, samples: list[dict]) -> float:
    """The largest difference between the gradients of a replayed step with and without full recomputation,
    over every stage's parameters: the recomputed forward must replay its own micro-batch's routing."""
    source = ModelSource.from_spec(ModelSpec(hf_checkpoint=checkpoint))
    tokens, _, _, prompts, lengths, replayed = laid_out(samples, RoutingShape.of(source.architecture))
    half = len(samples) // 2
    items = [
        padded_input(tokens[part], prompts[part], lengths[part], replayed[part])
        for part in (slice(0, half), slice(half, None))
    ]
    gradients = []
    for recompute in (Recompute.NONE, Recompute.FULL):
        model = source.build_policy(ModelOptions(recompute=recompute))
        RoutingReplay.attach(model)

        def score(index: int, hidden: torch.Tensor, model=model) -> torch.Tensor:
            logp, _ = token_scores(model, hidden, items[index].targets, 1.0, Entropy.NONE)
            return logp.sum()

        run_micro_batches(model, items, score, backward=True)
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    gap = (gradients[0] - gradients[1]).abs().max().reshape(1)
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    return gap.item()


def trained_weights(spec_path: Path, batch: RolloutBatch) -> list[torch.Tensor]:
    """This rank's parameters after a GRPO rollout of two steps on ``batch``, from the checkpoint's weights."""
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    spec = load_spec(spec_path, [*TRAINING, f"trainer.pipeline_parallel={stages}"])
    trainer, _ = solo_replica(spec, ModelSource.from_spec(spec.model).build_policy())
    context = trainer.prepare(0, batch)
    for index in range(batch.size // spec.trainer.global_batch_size):
        assert trainer.step(context, index).committed
    return [param.detach().clone() for param in trainer.model.parameters()]


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Over every stage's parameters."""
    gap = torch.stack([(x - y).abs().max() for x, y in zip(a, b)]).max().reshape(1)
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    return gap.item()


def replayed_training(checkpoint: Path, samples: list[dict], workdir: Path) -> dict[str, float]:
    """Weights trained on the samples' rollout as committed and read back, against those trained on it in
    memory, and against those trained on it without routing records."""
    source = ModelSource.from_spec(ModelSpec(hf_checkpoint=checkpoint))
    tokens, engine, mask, prompts, lengths, _ = laid_out(samples, RoutingShape.of(source.architecture))
    batch = RolloutBatch(
        tokens=tokens,
        prompt_lengths=prompts,
        response_lengths=lengths - prompts,
        engine_logprobs=engine,
        rewards=torch.rand(len(samples), generator=torch.Generator().manual_seed(5)),
        prompt_indices=torch.arange(len(samples)) // SAMPLES,
        prompt_epochs=torch.zeros(len(samples), dtype=torch.long),
        weight_versions=torch.zeros(len(samples), dtype=torch.long),
        loss_mask=mask,
        routed_experts=routing.stored(
            [sample["routing"] for sample in samples], tokens.shape[1], RoutingShape.of(source.architecture)
        ),
    )
    spec = yaml.safe_load(SPEC.read_text())
    spec["model"] = {"hf_checkpoint": str(checkpoint)}
    spec_path = workdir / f"{checkpoint.name}.yaml"
    if torch.distributed.get_rank() == 0:
        write_rollout(workdir, 0, batch, {})
        spec_path.write_text(yaml.safe_dump(spec))
    torch.distributed.barrier()
    committed, _ = read_rollout(workdir, 0)
    in_memory = trained_weights(spec_path, batch)
    return {
        "log_vs_memory": largest_difference(trained_weights(spec_path, committed), in_memory),
        "unrouted_vs_memory": largest_difference(
            trained_weights(spec_path, replace(committed, routed_experts=None)), in_memory
        ),
    }


def main() -> None:
    out, pp, checkpoints = Path(sys.argv[1]), int(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
    init_model_parallel(1, seed=3, pipeline_parallel=pp)
    for checkpoint in checkpoints:
        samples = asyncio.run(generate(checkpoint))
        result = gaps(checkpoint, samples)
        recompute_gap = recompute_gradient_gap(checkpoint, samples)
        training = replayed_training(checkpoint, samples, out / f"{checkpoint.name}-log")
        if result is not None:
            result.update(recompute_gradient_gap=recompute_gap, **training)
            (out / f"{checkpoint.name}.json").write_bytes(orjson.dumps(result))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
