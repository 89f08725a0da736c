"""elastic-rl against TRL's GRPOTrainer on the same job, on this machine, in one invocation.

    .venv/bin/pip install -e '.[bench]'        # TRL, pinned (never a runtime dependency)
    .venv/bin/python bench/trl_compare.py      # seeds 1234, 7 and 42; 10 iterations each
    .venv/bin/python bench/trl_compare.py --seeds 1234 --iterations 3     # a quick look
    .venv/bin/python bench/trl_compare.py --erl-set algorithm.use_rollout_logprobs=true

The job is examples/smollm2-math.yaml: the imported SmolLM2-135M-Instruct, the
project's arithmetic prompts through the chat template and its `math` reward,
8 prompts x 8 samples per iteration, 32 new tokens at temperature 1, four
optimizer steps of 16 samples, AdamW at 2e-5 (beta2 0.98, two warmup steps,
then constant, gradients clipped at 1), no KL, clip 0.2 / 0.28, two torch
threads. TRL gets the same: `generation_batch_size` 64, `num_generations` 8,
its `bnpo` loss (elastic-rl's default `token_mean`), fp32 (`bf16=False`: TRL
autocasts to bf16 on a CPU by default), activations kept rather than recomputed
(`gradient_checkpointing=False`, as elastic-rl), and the very prompts elastic-rl draws
for the seed, in its order (`shuffle_dataset=False`). elastic-rl runs as a user
runs it, `erl submit` to an erld already up; TRL as a script in a fresh
interpreter. The runs go one after another, alternating the two tools.

For each run: start-up (from launch to the end of the first iteration, less one
iteration), minutes per iteration after it (the median gap between iteration
ends), the reward of each iteration, the reward gain per wall-clock minute
(last three iterations' mean reward less the first's, over the minutes from
launch to the last iteration's end), and generated tokens per second of
iteration. For elastic-rl also where an iteration's time went
(metrics.jsonl's accounting). Results go in docs/benchmarks/trl.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, erl, job_status, running_daemon  # noqa: E402

SPEC = REPO / "examples" / "smollm2-math.yaml"
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
JOB = "smollm2-math"
PROMPTS, SAMPLES, STEPS = 8, 8, 4
LATE = 3  # iterations averaged at the end of a run


# --- TRL, in its own interpreter -------------------------------------------------------------------------


def trl_run(seed: int, iterations: int, out: Path) -> None:
    """Train with TRL's GRPOTrainer for ``iterations`` generations; write each iteration's end time, reward
    and mean completion length to ``out``."""
    import torch

    torch.set_num_threads(2)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from elastic_rl.rollout.data import DataSource
    from elastic_rl.rollout.rewards import math as math_reward
    from elastic_rl.spec.loading import load_spec

    spec = load_spec(SPEC, [f"seed={seed}"])
    drawn = DataSource(spec.data, seed).draw(PROMPTS * iterations)  # elastic-rl's prompts, in its order
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p.text}], "label": p.label} for p in drawn])

    def reward(prompts, completions, label, **kwargs) -> list[float]:
        return [math_reward("", completion[0]["content"], answer) for completion, answer in zip(completions, label)]

    iterations_done: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                iterations_done.append(
                    {
                        "end": time.time(),
                        "reward": float(logs["reward"]),
                        "length": float(logs["completions/mean_length"]),
                    }
                )

    with tempfile.TemporaryDirectory() as output:
        config = GRPOConfig(
            output_dir=output,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,  # TRL's default recomputes activations; elastic-rl keeps them
            seed=seed,
            shuffle_dataset=False,
            per_device_train_batch_size=PROMPTS * SAMPLES // STEPS,
            gradient_accumulation_steps=1,
            steps_per_generation=STEPS,
            num_generations=SAMPLES,
            max_completion_length=spec.rollout.max_new_tokens,
            temperature=spec.rollout.temperature,
            learning_rate=spec.trainer.lr,
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=spec.trainer.warmup_steps,
            adam_beta1=spec.trainer.adam_beta1,
            adam_beta2=spec.trainer.adam_beta2,
            weight_decay=spec.trainer.weight_decay,
            max_grad_norm=spec.trainer.clip_grad,
            beta=0.0,
            epsilon=spec.algorithm.eps_clip,
            epsilon_high=spec.algorithm.eps_clip_high,
            loss_type="bnpo",
            max_steps=STEPS * iterations,
            logging_steps=STEPS,  # one log line per generation: its reward
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(str(SMOLLM2), dtype=torch.float32),
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(str(SMOLLM2)),
            callbacks=[Record()],
        )
        trainer.train()
    out.write_text(json.dumps(iterations_done))


def run_trl(seed: int, iterations: int, root: Path) -> dict:
    out = root / f"trl-{seed}.json"
    launched = time.time()
    command = [sys.executable, __file__, "--trl-run", str(seed), "--iterations", str(iterations), "--out", str(out)]
    with open(root / f"trl-{seed}.log", "wb") as log:
        subprocess.run(command, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    done = json.loads(out.read_text())
    return summary("TRL", seed, launched, [d["end"] for d in done], [d["reward"] for d in done], None, done)


# --- elastic-rl, through erl ----------------------------------------------------------------------------


def run_elastic(seed: int, iterations: int, root: Path, overrides: list[str]) -> dict:
    workdir = root / f"erl-{seed}"
    sets = [arg for override in overrides for arg in ("--set", override)]
    with running_daemon(root / f"erld-{seed}", cpu_devices=4) as endpoint:
        launched = time.time()
        erl(
            "submit",
            str(SPEC),
            "--set",
            f"seed={seed}",
            "--set",
            f"rollout.num_rollouts={iterations}",
            *sets,
            "--workdir",
            str(workdir),
            "--etcd",
            endpoint,
        )
        while (phase := job_status(endpoint, JOB)["status"]["phase"]) != "succeeded":
            assert phase in ("pending", "running"), job_status(endpoint, JOB)
            time.sleep(2)
    lines = [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    ends = [line["time"] for line in lines]
    rewards = [line["rollout/reward_mean"] for line in lines]
    return summary(
        "elastic-rl", seed, launched, ends, rewards, [line["rollout/generated_tokens"] for line in lines], lines
    )


# --- the report -------------------------------------------------------------------------------------------


def summary(tool: str, seed: int, launched: float, ends: list[float], rewards: list[float], tokens, raw) -> dict:
    per_iteration = median(b - a for a, b in zip(ends, ends[1:]))
    if tokens is None:  # TRL reports the mean completion length of each generation
        tokens = [entry["length"] * PROMPTS * SAMPLES for entry in raw]
    gaps = [per_iteration] + [b - a for a, b in zip(ends, ends[1:])]
    return {
        "tool": tool,
        "seed": seed,
        "startup_min": (ends[0] - launched - per_iteration) / 60,
        "iteration_min": per_iteration / 60,
        "rewards": rewards,
        "gain_per_min": (mean(rewards[-LATE:]) - rewards[0]) / ((ends[-1] - launched) / 60),
        "tokens_per_s": mean(count / gap for count, gap in zip(tokens, gaps)),
        "accounting": accounting(raw) if tool == "elastic-rl" else None,
    }


ORCHESTRATOR_PARTS = (
    "rollout/wait_weights_time",
    "rollout/weights_load_time",
    "rollout/eval_time",
    "rollout/time",
    "rollout/commit_time",
)
TRAINER_PARTS = (
    "train/wait_rollout_time",
    "train/prepare_time",
    "train/rollout_train_time",
    "train/snapshot_call_time",
    "train/export_time",
)


def accounting(lines: list[dict]) -> dict[str, float]:
    """The mean seconds of each part of an iteration after the first, and of the whole."""
    later = [line for line in lines if "perf/iteration_time" in line]
    keys = ("perf/iteration_time", *ORCHESTRATOR_PARTS, *TRAINER_PARTS)
    return {key: mean(line.get(key, 0.0) for line in later) for key in keys}


def report(runs: list[dict]) -> None:
    print("tool        seed  start-up min  min/iteration  tokens/s  reward gain/min  rewards by iteration")
    for run in runs:
        rewards = " ".join(f"{reward:.2f}" for reward in run["rewards"])
        print(
            f"{run['tool']:10s} {run['seed']:5d}  {run['startup_min']:12.2f}  {run['iteration_min']:13.2f}  "
            f"{run['tokens_per_s']:8.1f}  {run['gain_per_min']:15.3f}  {rewards}"
        )
    by_tool = {tool: [run for run in runs if run["tool"] == tool] for tool in ("TRL", "elastic-rl")}
    means = {tool: {key: mean(run[key] for run in group) for key in RATIO_KEYS} for tool, group in by_tool.items()}
    print("\nmeans over the seeds, and elastic-rl / TRL:")
    for key in RATIO_KEYS:
        theirs, ours = means["TRL"][key], means["elastic-rl"][key]
        print(f"  {key:14s} TRL {theirs:8.3f}  elastic-rl {ours:8.3f}  ratio {ours / theirs:.2f}")
    for tool, group in by_tool.items():
        last = [run["rewards"][-1] for run in group]
        print(f"  reward at the last iteration, {tool}: {' '.join(f'{r:.2f}' for r in last)} (mean {mean(last):.3f})")
    parts = [run["accounting"] for run in by_tool["elastic-rl"]]
    print("\nelastic-rl, mean seconds per iteration after the first:")
    for key in parts[0]:
        print(f"  {key:28s} {mean(part[key] for part in parts):7.2f}")


RATIO_KEYS = ("startup_min", "iteration_min", "tokens_per_s", "gain_per_min")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 7, 42])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    parser.add_argument(
        "--erl-set", action="append", default=[], metavar="KEY=VALUE", help="a spec override for elastic-rl's runs"
    )
    parser.add_argument("--trl-run", type=int, help=argparse.SUPPRESS)  # the TRL interpreter's seed
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_run is not None:
        trl_run(args.trl_run, args.iterations, args.out)
        return
    assert (SMOLLM2 / "config.json").is_file(), f"{SMOLLM2} is missing: run `make models`"
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        runs = []
        for seed in args.seeds:
            runs.append(run_trl(seed, args.iterations, root))
            runs.append(run_elastic(seed, args.iterations, root, args.erl_set))
            (root / "runs.json").write_text(json.dumps(runs))
        report(runs)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
