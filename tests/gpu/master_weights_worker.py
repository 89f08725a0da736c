"""bf16 parameters with fp32 main weights (``trainer.dtype: bf16-params``) on one GPU, started by
test_gpu_master_weights.py.

    python -m tests.gpu.master_weights_worker OUT_DIR   (RANK, WORLD_SIZE, MASTER_* set, a GPU each)

The ranks form one replica of WORLD_SIZE data-parallel ranks, under ``FakeSoloQuorum``. The tiny model
trains the data-parallel test's synthetic rollout from the same seeded weights twice, in fp32 (AdamW whole
on each rank) and in bf16-params. Then the bf16-params state is snapshotted and loaded into a fresh
bf16-params replica and into an fp32 one, and handed to a third through the heal transport (rank to rank);
the live replica and the two bf16-params copies take one more step. Last, the live replica's next step
has NaN logits on its first try (the chaos harness's injection): the guard skips it, and the step retried
gives the resumed copy's weights bitwise. Each rank writes what the test compares.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import orjson
import torch

from checkpoints.layout import snapshot_path
from checkpoints.snapshot import SnapshotWriter, TrainingState, load_snapshot
from elastic_rl.model.gpt import ModelOptions, init_model_parallel
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.loading import load_spec
from elastic_rl.trainer.grpo import GrpoTrainer, NonFiniteStep
from elastic_rl.trainer.heal_transport import LoopbackTransport
from elastic_rl.trainer.nan_injection import NanFault, NanInjector
from elastic_rl.trainer.optimizer import take_scheduled_rates
from policies.devices import Precision
from tests.integration.data_parallel_worker import COMMON, STEPS, rollout, train
from tests.processes import SPEC
from tests.trainer_doubles import solo_replica


def replica(dtype: str, initial: dict | None = None) -> tuple[GrpoTrainer, TrainingState]:
    layout = [f"trainer.data_parallel={torch.distributed.get_world_size()}", "trainer.shard_optimizer=false"]
    if dtype == "bf16-params":
        layout = layout[:1]  # megatron's distributed optimizer shards
    spec = load_spec(SPEC, [*COMMON, *layout, f"trainer.dtype={dtype}"])
    model = ModelSource.from_spec(spec.model).build_policy(ModelOptions(Precision(dtype)), "cuda")
    if initial is not None:
        model.load_state_dict(initial)
    return solo_replica(spec, model)


def weights(state: TrainingState) -> dict[str, torch.Tensor]:
    """The fp32 weights: the main weights in bf16-params."""
    main = state.main_weights
    return {
        name: (param.detach() if main is None else main.whole(param)["weight"]).float().clone()
        for name, param in state.model.named_parameters()
    }


def moments(state: TrainingState) -> list[torch.Tensor]:
    main = state.main_weights
    values = []
    for param in state.model.parameters():
        adam = state.optimizer.state[param] if main is None else main.whole(param)
        values += [adam["exp_avg"].float(), adam["exp_avg_sq"].float(), adam["step"].float().cpu()]
    return values


def bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def main() -> None:
    out = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True, warn_only=True)
    init_model_parallel(1, seed=7)
    fp32, fp32_state = replica("fp32")
    initial = {name: v.clone() if torch.is_tensor(v) else v for name, v in fp32.model.state_dict().items()}
    bf16, bf16_state = replica("bf16-params", initial)
    start = weights(fp32_state)
    batch = rollout(len(ModelSource.from_spec(fp32.spec.model).tokenizer))
    losses = {}
    for name, trainer in (("fp32", fp32), ("bf16-params", bf16)):
        context = trainer.prepare(0, batch)
        for index in range(STEPS - 1):
            assert trainer.step(context, index).committed
        losses[name] = context.metrics.values["loss"]

    # Each weight's update in bf16-params against fp32's: the same direction, near the same size.
    fp32_after, bf16_after = weights(fp32_state), weights(bf16_state)
    fp32_moves = torch.cat([(fp32_after[n] - start[n]).reshape(-1) for n in start])
    bf16_moves = torch.cat([(bf16_after[n] - start[n]).reshape(-1) for n in start])
    main = bf16_state.main_weights
    result = {
        "losses": losses,
        "update_cosine": torch.nn.functional.cosine_similarity(fp32_moves, bf16_moves, dim=0).item(),
        "update_norm_ratio": (bf16_moves.norm() / fp32_moves.norm()).item(),
        "parameter_dtypes": sorted({str(p.dtype) for p in bf16.model.parameters()}),
        "gradient_dtypes": sorted({str(p.main_grad.dtype) for p in bf16.model.parameters()}),
        "main_dtypes": sorted({str(m.dtype) for m, _ in main.shards.values()}),
        "parameter_elements": sum(p.numel() for p in bf16.model.parameters()),
        "main_elements": sum(m.numel() for m, _ in main.shards.values()),
        # The bf16 parameters are the main weights rounded (gathered over the data-parallel ranks).
        "parameters_are_main_rounded": all(
            [torch.equal(p, main.whole(p)["weight"].to(torch.bfloat16)) for p in bf16.model.parameters()]
        ),
    }

    writer = SnapshotWriter(out, async_save=False)
    writer.save(bf16_state, step=STEPS - 1, last_rollout=0, spec_hash="")
    path = snapshot_path(out, STEPS - 1)
    resumed, resumed_state = replica("bf16-params")  # from the seed, then the snapshot
    load_snapshot(resumed_state, path, writer.group)
    result["snapshot_weights_bitwise"] = bitwise(list(weights(resumed_state).values()), list(bf16_after.values()))
    result["snapshot_moments_bitwise"] = bitwise(moments(resumed_state), moments(bf16_state))
    as_fp32, as_fp32_state = replica("fp32")
    load_snapshot(as_fp32_state, path, writer.group)
    result["fp32_load_weights_bitwise"] = bitwise(list(weights(as_fp32_state).values()), list(bf16_after.values()))
    result["fp32_load_moments_bitwise"] = bitwise(moments(as_fp32_state), moments(bf16_state))

    # A heal: the live replica's state through the transport a peer reads it from.
    transport = LoopbackTransport(timedelta(seconds=60), secret="worker")
    offered = {"model": bf16.model.state_dict(), "optim": main.state_dict(), "scheduler": bf16.scheduler.state_dict()}
    transport.send_checkpoint([], step=1, state_dict=offered, timeout=timedelta(seconds=60))
    taken = transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=60))
    transport.shutdown()
    healed, healed_state = replica("bf16-params")
    healed.model.load_state_dict(taken["model"])
    healed_state.main_weights.load_state_dict(taken["optim"])
    healed.scheduler.load_state_dict(taken["scheduler"])
    take_scheduled_rates(healed.optimizer, healed.scheduler)
    result["healed_weights_bitwise"] = bitwise(list(weights(healed_state).values()), list(bf16_after.values()))

    # One more step from each copy: the same as the live replica's.
    for trainer in (bf16, resumed, healed):
        train(trainer, batch, range(STEPS - 1, STEPS))
    after = list(weights(bf16_state).values())
    result["resumed_step_bitwise"] = bitwise(list(weights(resumed_state).values()), after)
    result["healed_step_bitwise"] = bitwise(list(weights(healed_state).values()), after)
    result["parameters_after_resumed_step_bitwise"] = bitwise(
        list(resumed.model.parameters()), list(bf16.model.parameters())
    )

    # A NaN in one try of the next step (the rollout's first again): skipped, and nothing of it left in the
    # buffers or the main weights.
    NanInjector(NanFault(frozenset([bf16.manager.current_step()]), replica=None, attempts=1)).install(bf16)
    try:
        train(bf16, batch, range(1))
        result["nan_step_skipped"] = False
    except NonFiniteStep:
        result["nan_step_skipped"] = True
    result["nan_step_left_weights"] = bitwise(list(weights(bf16_state).values()), after)
    for trainer in (bf16, resumed):
        train(trainer, batch, range(1))
    result["step_after_nan_bitwise"] = bitwise(
        list(weights(bf16_state).values()), list(weights(resumed_state).values())
    )
    (out / f"result.{torch.distributed.get_rank()}.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main()
