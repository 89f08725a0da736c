"""Benchmark: partial rollout against waiting for every request, at an over-sampling ratio where
aborts happen: generated tokens never trained, and the wall time of a rollout.

    .venv/bin/python bench/partial_rollout_bench.py      # about 3 minutes

Runs examples/tiny-grpo.yaml for 20 rollouts once per variant, one job after another under one
erld: 8 prompts a rollout, 4 samples each, rounds of 16 prompts, responses that end at one of three
digits or at 48 tokens (a long tail), at most 16 requests in flight (so some are mid-way when the
rollout is full). It prints for each the mean generation time of a rollout (rollout/time), the
mean time between two trained rollouts (after the first 2), the tokens generated, and how many of
them were trained, are still buffered at the end, or were never trained (dropped as stale).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import layout  # noqa: E402
from checkpoints.rollout_log import read_rollout  # noqa: E402

from harness import SPEC, erl, job_status, running_daemon  # noqa: E402

ROLLOUTS = 20
JOB = [
    f"rollout.num_rollouts={ROLLOUTS}",
    "rollout.prompts_per_rollout=8",
    "rollout.n_samples_per_prompt=4",
    "rollout.over_sampling_batch_size=16",
    "rollout.max_new_tokens=48",
    "rollout.stop_token_ids=[4,5,6]",  # "0", "1", "2": response lengths with a long tail, as real ones have
    "rollout.max_concurrency=16",
    "trainer.global_batch_size=32",
    "trainer.micro_batch_size=32",
    "checkpoints.keep_last=1000",
]
VARIANTS = {
    "every request to its end": [],
    "partial rollout": ["rollout.partial_rollout=true"],
}


def tokens(workdir: Path) -> tuple[float, int, int]:
    """Tokens generated, trained, and still buffered at the end."""
    lines = [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    generated = sum(line["rollout/generated_tokens"] for line in lines)
    trained = 0
    for rollout_id in layout.committed_rollouts(workdir):
        trained += int(read_rollout(workdir, rollout_id)[0].response_lengths.sum())
    buffer = read_rollout(workdir, ROLLOUTS - 1)[1]["buffer"]
    buffered = sum(len(sample["output_ids"]) for group in buffer for sample in group["samples"])
    return generated, trained, buffered


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="erl-partial-rollout-bench-"))
    print(
        "| variant | generation s per rollout | s between trained rollouts | tokens generated | trained "
        "| still buffered | never trained |"
    )
    print("|---|---|---|---|---|---|---|")
    with running_daemon(root, cpu_devices=4) as endpoint:
        for number, (variant, overrides) in enumerate(VARIANTS.items()):
            name, workdir = f"tiny-{number}", root / str(number)
            sets = [arg for o in [f"name={name}", *JOB, *overrides] for arg in ("--set", o)]
            erl("submit", str(SPEC), *sets, "--workdir", str(workdir), "--etcd", endpoint)
            while (phase := job_status(endpoint, name)["status"]["phase"]) not in ("succeeded", "failed"):
                time.sleep(1)
            assert phase == "succeeded", job_status(endpoint, name)
            lines = [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
            generation = mean(line["rollout/time"] for line in lines[2:])
            gap = (lines[-1]["time"] - lines[2]["time"]) / (len(lines) - 3)
            generated, trained, buffered = tokens(workdir)
            never = generated - trained - buffered
            print(
                f"| {variant} | {generation:.3f} | {gap:.2f} | {generated:.0f} | {trained} | {buffered} | "
                f"{never:.0f} ({never / generated:.1%}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
