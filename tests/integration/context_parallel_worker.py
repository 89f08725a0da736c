"""A replica whose samples are split over context-parallel ranks, started by test_context_parallel.py.

    python -m tests.integration.context_parallel_worker OUT_DIR TP MODE [DP [PP [sp]]]   (RANK, WORLD_SIZE =
    TP x CP x PP x DP, MASTER_*)

MODE ``attention``: megatron's groups at CP = WORLD_SIZE (over NCCL where the ranks were given GPUs); the
project's attention of a packed micro-batch
of samples of several lengths (none a multiple of 2 x CP), split over the ranks, against the same
attention unsplit on every rank. Each rank writes the largest gaps of its tokens' outputs and of the
query, key and value gradients of a weighted sum of them.

MODE ``train``: one replica of TP x CP x PP x DP ranks (DP and PP 1 unless given, AdamW sharded over DP,
the layers in PP pipeline stages, with ``sp`` sequence parallelism over the TP ranks) trains the tiny
model for three GRPO steps on a synthetic
rollout, packed micro-batches cut by a token budget, then snapshots it. Rank 0 writes the gathered
weights (OUT_DIR/weights.pt) and every rank the old-policy log probs of the rollout
(OUT_DIR/logprobs.<rank>.pt). MODE ``load``: a replica of one rank loads that snapshot and writes its
weights (OUT_DIR/loaded.pt).

The quorum is ``FakeSoloQuorum``: one replica, every step committed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import orjson
import torch
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig

from checkpoints.discovery import newest_valid_snapshot
from checkpoints.snapshot import SnapshotWriter, load_snapshot
from elastic_rl.device import assigned
from elastic_rl.model.attention import FusedAttention
from elastic_rl.model.gpt import init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.packing import packed_input
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.loading import load_spec
from tests.integration.data_parallel_worker import COMMON, rollout
from tests.processes import SPEC
from tests.trainer_doubles import solo_replica

STEPS = 3
LENGTHS = [13, 7, 13, 22, 5]
"""Samples of a packed micro-batch, two of one length (one fused call per chunk and length)."""


def attention(out: Path, context_parallel: int) -> None:
    rank = parallel_state.get_context_parallel_rank()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    item = packed_input(tokens, torch.full((len(LENGTHS),), 2), torch.tensor(LENGTHS))
    total = int(item.bounds[-1])
    device = torch.device(assigned().torch_device)  # a GPU over NCCL (tests/gpu), else the CPU over gloo
    query, key, value = (torch.randn(total, heads, 16, generator=generator).to(device) for heads in (4, 2, 2))
    weights = torch.randn(total, 4 * 16, generator=generator).to(device)

    def attended(size: int, inputs: list[torch.Tensor], params, out_weights: torch.Tensor) -> list[torch.Tensor]:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            kv_channels=16,
            context_parallel_size=size,
            use_cpu_initialization=True,
        )
        inputs = [tensor.clone().requires_grad_() for tensor in inputs]
        result = FusedAttention(config, 1, None, "self")(*inputs, None, packed_seq_params=params)
        (result * out_weights).sum().backward()
        return [result.detach(), *(tensor.grad for tensor in inputs)]

    whole = attended(1, [query, key, value], item.seq_params(query.device), weights)
    local = item.split_over_context(rank, context_parallel)
    held = held_positions(item, rank, context_parallel).to(device)
    real = held >= 0

    def mine(tensor: torch.Tensor) -> torch.Tensor:
        share = tensor.new_zeros(len(held), *tensor.shape[1:])
        share[real] = tensor[held[real]]
        return share

    split = attended(
        context_parallel, [mine(t) for t in (query, key, value)], local.seq_params(query.device), mine(weights)
    )
    gaps = {
        name: (ours[real] - theirs[held[real]]).abs().max().item()
        for name, ours, theirs in zip(("output", "query", "key", "value"), split, whole)
    }
    (out / f"attention.{rank}.json").write_bytes(orjson.dumps(gaps))


def held_positions(item, rank: int, ranks: int) -> torch.Tensor:
    """Which of ``item``'s packed positions each of this rank's slots holds (-1: padding), written out
    independently of ``ModelInput.split_over_context``: rank r holds chunks r and 2 x ranks - 1 - r of each sample."""
    pieces, held = 2 * ranks, []
    bounds = item.bounds.tolist()
    for start, end in zip(bounds, bounds[1:]):
        chunk = -(-(end - start) // pieces)
        for index in (rank, pieces - 1 - rank):
            held += [start + o if start + o < end else -1 for o in range(index * chunk, (index + 1) * chunk)]
    return torch.tensor(held)


def spec_at(
    tensor_parallel: int,
    context_parallel: int,
    data_parallel: int = 1,
    pipeline_parallel: int = 1,
    *,
    sequence_parallel: bool = False,
):
    layout = [
        f"trainer.tensor_parallel={tensor_parallel}",
        f"trainer.context_parallel={context_parallel}",
        f"trainer.data_parallel={data_parallel}",
        f"trainer.pipeline_parallel={pipeline_parallel}",
        f"trainer.sequence_parallel={str(sequence_parallel).lower()}",
    ]
    return load_spec(SPEC, [*COMMON, *layout, "trainer.max_tokens_per_micro_batch=60"])


def train(
    out: Path,
    tensor_parallel: int,
    context_parallel: int,
    data_parallel: int,
    pipeline_parallel: int,
    *,
    sequence_parallel: bool,
) -> None:
    spec = spec_at(
        tensor_parallel, context_parallel, data_parallel, pipeline_parallel, sequence_parallel=sequence_parallel
    )
    source = ModelSource.from_spec(spec.model)
    trainer, state = solo_replica(spec, source.build_policy())
    batch = rollout(len(source.tokenizer))
    context = trainer.prepare(0, batch)
    for index in range(STEPS):
        assert trainer.step(context, index).committed
    rank = torch.distributed.get_rank()
    torch.save(context.old_logp, out / f"logprobs.{rank}.pt")
    writer = SnapshotWriter(out / "work", async_save=False)
    writer.save(state, step=STEPS, last_rollout=0, spec_hash="test")
    weights = full_state_dict(trainer.model)
    if rank == 0:
        torch.save(weights, out / "weights.pt")


def load(out: Path) -> None:
    spec = spec_at(1, 1)
    _, state = solo_replica(spec, ModelSource.from_spec(spec.model).build_policy())
    snapshot = newest_valid_snapshot(out / "work")
    load_snapshot(state, snapshot.path, torch.distributed.new_group(backend="gloo"))
    torch.save(full_state_dict(state.model), out / "loaded.pt")


def main() -> None:
    out, tensor_parallel, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    data_parallel = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    pipeline_parallel = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    sequence_parallel = len(sys.argv) > 6 and sys.argv[6] == "sp"
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    context_parallel = int(os.environ["WORLD_SIZE"]) // (tensor_parallel * data_parallel * pipeline_parallel)
    init_model_parallel(tensor_parallel, seed=5, context_parallel=context_parallel, pipeline_parallel=pipeline_parallel)
    if mode == "attention":
        attention(out, context_parallel)
    elif mode == "train":
        train(
            out,
            tensor_parallel,
            context_parallel,
            data_parallel,
            pipeline_parallel,
            sequence_parallel=sequence_parallel,
        )
    else:
        load(out)


if __name__ == "__main__":
    main()
