"""Benchmark: rollout routing replay for a mixture of experts: what the routing records weigh, what replay
costs a trainer step, and what it changes in a job whose engine and trainer route near ties apart.

    .venv/bin/python bench/routing_replay_bench.py [--rollouts 20] [--steps 6]

1. Jobs: the tiny job (examples/tiny-grpo.yaml, seed 1234, deterministic engines) on a random
   Qwen3-MoE (2 layers, 4 experts, 2 per token, the toy tokenizer) whose expert 1's router row in every
   layer is expert 0's plus noise of 1e-8, so the engine and the trainer choose differently between the
   two wherever they are a token's second and third choice. Run --rollouts rollouts with
   algorithm.routing_replay off and on, one job after the other under one erld: per rollout the
   largest |trainer - engine| log prob of the samples the trainer's weights generated, the routing
   agreement, and the mean reward.
2. Records: the committed rollouts of the replayed job: the routing record's bytes per token and its
   share of the batch file; and the same per token for the routing shapes of released mixtures of
   experts, beside the tokens, log probs and loss mask a rollout stores per token (16 bytes).
3. Step time: one rank, one thread, a trainer step of a random Qwen3-MoE (hidden 512, 4 layers, 8
   experts, 2 per token) on a synthetic rollout, replaying a routing record against routing itself,
   alternately twice; the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SPEC, erl, job_status, running_daemon  # noqa: E402

RELEASED = {  # name: (MoE layers, experts per token, experts)
    "Qwen3-30B-A3B": (48, 8, 128),
    "Qwen3-235B-A22B": (94, 8, 128),
    "Mixtral-8x7B": (32, 2, 8),
}
PER_TOKEN_BYTES = 8 + 4 + 4  # a rollout's token (int64), engine log prob and loss mask (float32)


def tied_checkpoint(root: Path) -> Path:
    from tests.integration.test_moe import moe_checkpoint
    from tests.integration.test_routing_replay import QWEN3_MOE, near_tie_checkpoint

    return near_tie_checkpoint(moe_checkpoint(root / "plain", **QWEN3_MOE), root / "tied")


def jobs(root: Path, rollouts: int) -> dict[bool, list[dict]]:
    """The tiny job on the near-tie model, without and with replay: each rollout's metrics."""
    import yaml

    checkpoint = tied_checkpoint(root)
    spec = yaml.safe_load(SPEC.read_text())
    spec["model"] = {"hf_checkpoint": str(checkpoint)}
    spec_path = root / "tied.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    lines = {}
    with running_daemon(root, cpu_devices=4) as endpoint:
        for replay in (False, True):
            name, workdir = f"tied-replay-{str(replay).lower()}", root / f"replay-{replay}"
            settings = [f"name={name}", f"rollout.num_rollouts={rollouts}", f"algorithm.routing_replay={replay}"]
            overrides = [arg for setting in settings for arg in ("--set", setting)]
            erl("submit", str(spec_path), *overrides, "--workdir", str(workdir), "--etcd", endpoint)
            while (phase := job_status(endpoint, name)["status"]["phase"]) not in ("succeeded", "failed"):
                time.sleep(1)
            assert phase == "succeeded", job_status(endpoint, name)
            lines[replay] = [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return lines


def record_sizes(workdir: Path) -> tuple[float, float]:
    """(routing bytes per token, routing's share of the batch files) over a job's committed rollouts."""
    from safetensors.torch import load_file

    routing = batch = tokens = 0
    for folder in sorted((workdir / "rollouts").iterdir()):
        path = folder / "batch.safetensors"
        if not path.is_file():
            continue
        tensors = load_file(str(path))
        routed = tensors["routed_experts"]
        routing += routed.numel() * routed.element_size()
        tokens += tensors["tokens"].numel()
        batch += path.stat().st_size
    return routing / tokens, routing / batch


def step_times(replay: bool, steps: int, spec_path: Path, checkpoint: Path) -> list[float]:
    from moe_bench import timed_steps

    from elastic_rl import routing_record as routing
    from elastic_rl.model.source import ModelSource
    from elastic_rl.spec.loading import load_spec
    from elastic_rl.spec.model import ModelSpec
    from tests.integration import data_parallel_worker as worker
    from tests.integration.tensor_parallel_worker import random_routing
    from tests.trainer_doubles import solo_replica

    spec = load_spec(spec_path, [*worker.COMMON, f"algorithm.routing_replay={replay}"])
    source = ModelSource.from_spec(ModelSpec(hf_checkpoint=checkpoint))
    trainer, _ = solo_replica(spec, source.build_policy())
    batch = worker.rollout(len(source.tokenizer))
    if replay:
        shape = routing.RoutingShape.of(source.architecture)
        batch.routed_experts = random_routing(batch.tokens.shape, shape, seed=0)
    return timed_steps(trainer, batch, steps)


def step_cost(root: Path, steps: int) -> tuple[float, float]:
    import torch
    import yaml
    from moe_bench import checkpoints

    from elastic_rl.model.gpt import init_model_parallel
    from elastic_rl.net import LOOPBACK, free_port

    torch.set_num_threads(1)
    init_model_parallel(1, seed=7, init_method=f"tcp://{LOOPBACK}:{free_port()}")
    checkpoint = checkpoints(root, "small", 512, 4, 8, 512)["moe"]
    spec = yaml.safe_load(SPEC.read_text())
    spec["model"] = {"hf_checkpoint": str(checkpoint)}
    spec_path = root / "small-moe.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    times: dict[bool, list[float]] = {False: [], True: []}
    for replay in (False, True, False, True):
        times[replay] += step_times(replay, steps, spec_path, checkpoint)
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="erl-routing-replay-bench-"))
    try:
        lines = jobs(root, args.rollouts)
        columns = ["on-policy log-prob gap, no replay", "with replay", "routing agreement", "reward, no replay"]
        print(f"| rollout | {' | '.join(columns)} | with replay |")
        print("|---|---|---|---|---|---|")
        for off, on in zip(lines[False], lines[True]):
            gap, reward = "train/on_policy_logprob_abs_diff_max", "rollout/reward_mean"
            cells = [f"{off[gap]:.2e}", f"{on[gap]:.2e}", f"{on['train/routing_agreement']:.4f}"]
            cells += [f"{off[reward]:.3f}", f"{on[reward]:.3f}"]
            print(f"| {off['rollout']} | {' | '.join(cells)} |")
        per_token, share = record_sizes(root / "replay-True")
        print(f"\nrouting record of the tied model: {per_token:.1f} bytes per token, {share:.1%} of the batch files")
        print("\n| model | routing bytes per token | share beside 16 bytes of token, log prob and mask |")
        print("|---|---|---|")
        for name, (layers, per_token_experts, experts) in RELEASED.items():
            size = layers * per_token_experts * (1 if experts < 255 else 2)
            print(f"| {name} | {size} | {size / (size + PER_TOKEN_BYTES):.0%} |")
        off, on = step_cost(root, args.steps)
        print(f"\nstep time, hidden 512 MoE: routing itself {off:.3f} s, replaying {on:.3f} s, ratio {on / off:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
