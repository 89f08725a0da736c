"""Benchmark: torchft's per-step cost, against the same training with one replica and no quorum.

    .venv/bin/python bench/torchft_overhead.py

One process, one replica, the real GRPO step (``GrpoTrainer.step``) on a
synthetic rollout batch. Steps alternate in blocks between a trainer under a
real torchft Manager (a lighthouse process, a quorum, the commit vote and the
Gloo all-reduce every step) and the same trainer under ``FakeSoloQuorum``, which
does none of that. Reported: the median step time of each and their ratio, for
the tiny example model and a wider one (torchft's cost per step is fixed, so it
shrinks as the step grows). Target: overhead <= 10%.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from statistics import median

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints.rollout_log import RolloutBatch, response_mask  # noqa: E402
from elastic_rl.model.gpt import build_gpt, init_model_parallel  # noqa: E402
from elastic_rl.spec.loading import load_spec  # noqa: E402
from elastic_rl.trainer.grpo import GrpoTrainer  # noqa: E402
from elastic_rl.trainer.lr_schedule import lr_lambda  # noqa: E402
from tests.trainer_doubles import FakeSoloQuorum  # noqa: E402

from harness import REPO, SPEC, free_port  # noqa: E402

MODELS = {
    "tiny": [],
    "wide": ["model.hidden_size=256", "model.num_layers=4", "model.ffn_hidden_size=1024"],
}


def synthetic_batch(samples: int, seed: int) -> RolloutBatch:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 60, (samples, 10), generator=generator)
    return RolloutBatch(
        tokens=tokens,
        prompt_lengths=torch.full((samples,), 2),
        response_lengths=torch.full((samples,), 8),
        engine_logprobs=torch.zeros(samples, 10),
        rewards=torch.randint(0, 2, (samples,), generator=generator).float(),
        prompt_indices=torch.arange(samples) // 16,
        prompt_epochs=torch.zeros(samples, dtype=torch.long),
        weight_versions=torch.zeros(samples, dtype=torch.long),
        loss_mask=response_mask(torch.full((samples,), 2), torch.full((samples,), 8), 10),
    )


def trainer_for(spec, manager) -> GrpoTrainer:
    model = build_gpt(spec.model.toy_architecture(64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.trainer.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec.trainer, 10_000))
    return GrpoTrainer(spec, model, optimizer, scheduler, manager, replica=0)


def measure(model: str, blocks: int, steps_per_block: int, lighthouse: str) -> dict[str, float]:
    from torchft import Manager, ProcessGroupGloo

    spec = load_spec(SPEC, MODELS[model])
    timeout = timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        load_state_dict=lambda s: None,
        state_dict=lambda: {},
        replica_id=f"bench-{model}-0",
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        rank=0,
        world_size=1,
        use_async_quorum=False,
        init_sync=False,
        timeout=timeout,
        quorum_timeout=timeout,
    )
    trainers = {"torchft": trainer_for(spec, manager), "no_quorum": trainer_for(spec, FakeSoloQuorum())}
    batch = synthetic_batch(spec.rollout.samples_per_rollout, spec.seed)
    contexts = {name: trainer.prepare(0, batch) for name, trainer in trainers.items()}
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for block in range(blocks):
        for name, trainer in trainers.items():
            for _ in range(steps_per_block):
                started = time.perf_counter()
                trainer.manager.start_quorum()
                trainer.step(contexts[name], 0)
                if block:  # the first block warms up
                    times[name].append(time.perf_counter() - started)
    manager.shutdown(wait=False)
    ft, plain = median(times["torchft"]), median(times["no_quorum"])
    return {"step_torchft_s": ft, "step_no_quorum_s": plain, "overhead": ft / plain - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps-per-block", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    init_model_parallel(1, 1234)
    port = free_port()
    lighthouse = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "torchft_lighthouse"),
            "--min_replicas",
            "1",
            "--bind",
            f"127.0.0.1:{port}",
            "--join_timeout_ms",
            "100",
            "--heartbeat_timeout_ms",
            "1000",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1)
        for model in MODELS:
            result = measure(model, args.blocks, args.steps_per_block, f"http://127.0.0.1:{port}")
            print(orjson.dumps({"model": model, **{k: round(v, 4) for k, v in result.items()}}).decode(), flush=True)
    finally:
        lighthouse.kill()
        lighthouse.wait()


if __name__ == "__main__":
    main()
