"""One rank of a snapshot round trip, started by test_snapshots.py.

    python -m tests.integration.snapshot_worker MODE WORKDIR [RESULT]   (RANK, WORLD_SIZE, MASTER_* set)

MODE ``save``: build the tiny model and a critic of its shape (PPO's, with its
value head) at TP = WORLD_SIZE, take 3 AdamW steps of each, snapshot (async),
take 2 more steps, and write the full weights of both after each phase.
MODE ``load``: build at TP = WORLD_SIZE, restore the newest snapshot, write the
restored full weights, take the same 2 steps, write the weights.
MODE ``load-offloaded``: ``load`` with the optimizer's state in host memory
(``HostAdamW``, as trainer.optimizer_offload builds it).
MODE ``full-disk``: the policy alone, on a work dir with room for one snapshot,
save at steps 1 and 2 (the second runs out of space), free the first, save at
step 3; record which saves failed and whether training went on.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from checkpoints.discovery import newest_valid_snapshot
from checkpoints.layout import snapshot_path
from checkpoints.snapshot import SnapshotWriter, TrainingState, load_snapshot
from elastic_rl.model.gpt import build_gpt, decoder_states, destroy_model_parallel, forward_gpt, init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.packing import padded_input
from elastic_rl.model.value_head import attach_value_head, token_values
from elastic_rl.model.vocab_parallel import token_log_probs
from elastic_rl.spec.model import ModelSpec
from elastic_rl.trainer.host_adamw import HostAdamW

SPEC = ModelSpec(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96)


def step(state: TrainingState, batch: torch.Tensor) -> None:
    loss = -token_log_probs(forward_gpt(state.model, batch[:, :-1]), batch[:, 1:]).mean()
    if state.critic is not None:
        critic = state.critic.model
        lengths = torch.full((batch.shape[0],), batch.shape[1])
        values = token_values(critic, decoder_states(critic, padded_input(batch, lengths // 2, lengths)))
        loss = loss + ((values - 1) ** 2).mean()
    for _, part in state.parts():
        part.optimizer.zero_grad()
    loss.backward()
    for _, part in state.parts():
        part.optimizer.step()
        part.scheduler.step()


def training_state(model: torch.nn.Module, offloaded: bool) -> TrainingState:
    trained = [param for param in model.parameters() if param.requires_grad]
    optimizer = (HostAdamW if offloaded else torch.optim.AdamW)(trained, lr=3e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return TrainingState(model, optimizer, scheduler, optimizer_on_host=offloaded)


def main() -> None:
    mode, workdir = sys.argv[1], Path(sys.argv[2])
    torch.use_deterministic_algorithms(True)
    tp = int(os.environ["WORLD_SIZE"])
    init_model_parallel(tp, seed=5)
    model = build_gpt(SPEC.toy_architecture(64), tp)
    critic = build_gpt(SPEC.toy_architecture(64), tp)
    attach_value_head(critic)
    offloaded = mode == "load-offloaded"
    state = training_state(model, offloaded)
    scheduler = state.scheduler
    batch = torch.randint(4, 60, (4, 16), generator=torch.Generator().manual_seed(0))
    rank0 = torch.distributed.get_rank() == 0
    out = workdir / f"{mode}-tp{tp}"
    if mode == "full-disk":  # the policy alone: the disk has room for one snapshot of it
        failed = []
        writer = SnapshotWriter(
            workdir, async_save=True, on_failed=lambda step, error: failed.append((step, repr(error)))
        )
        for step_number in (1, 2, 3):
            step(state, batch)
            if step_number == 3 and rank0:
                shutil.rmtree(snapshot_path(workdir, 1))  # what retention does: room again
            torch.distributed.barrier()
            writer.save(state, step=step_number, last_rollout=step_number, spec_hash="test")
            writer.wait()
        torch.distributed.barrier()
        if rank0:
            Path(sys.argv[3]).write_text(json.dumps({"failed": failed, "newest": newest_valid_snapshot(workdir).step}))
        destroy_model_parallel()
        return
    state.critic = training_state(critic, offloaded)
    if mode == "save":
        writer = SnapshotWriter(workdir, async_save=os.environ.get("ASYNC", "1") == "1")
        for _ in range(3):
            step(state, batch)
        writer.save(state, step=3, last_rollout=7, spec_hash="test")
        snapshot_weights = full_state_dict(model) | prefixed(full_state_dict(critic))
        writer.wait_staged()  # before the optimizer changes what the snapshot copies
        for _ in range(2):
            step(state, batch)
        writer.wait()
        final = full_state_dict(model) | prefixed(full_state_dict(critic))
    else:
        info = newest_valid_snapshot(workdir)
        assert (info.step, info.last_rollout) == (3, 7), info
        assert load_snapshot(state, info.path, torch.distributed.new_group(backend="gloo")) == (3, 7)
        snapshot_weights = full_state_dict(model) | prefixed(full_state_dict(critic))
        assert scheduler.last_epoch == 3 and state.critic.scheduler.last_epoch == 3
        for _ in range(2):
            step(state, batch)
        final = full_state_dict(model) | prefixed(full_state_dict(critic))
    if rank0:
        torch.save({"snapshot": snapshot_weights, "final": final}, str(out) + ".pt")
    destroy_model_parallel()


def prefixed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"critic.{name}": value for name, value in weights.items()}


if __name__ == "__main__":
    main()
