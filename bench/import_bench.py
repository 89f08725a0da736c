"""Benchmark: how long each process kind's imports take, in this tree against another checkout.

    .venv/bin/python bench/import_bench.py --baseline PATH [--repeats 5]

For each kind (its module is what erld's pool pre-imports, ``daemon.pool.MODULES``) it starts
fresh interpreters that import the module and then do what the process does first that imports
more (the trainer builds a torch optimizer, which imports dynamo), alternating between this tree
and the baseline so that both see the same machine. It reports the median wall time per kind and
tree, the ratio, and the modules each loaded; whether torch's inductor compiler and W&B were among
them. PATH is another checkout (``git worktree add /tmp/before HEAD~1``) using this tree's venv.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from daemon.pool import MODULES  # noqa: E402

PROBE = """
import sys, time
start = time.perf_counter()
import {module}
if {kind!r} == "trainer":
    import torch
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
print(__import__("json").dumps({{
    "seconds": time.perf_counter() - start,
    "modules": len(sys.modules),
    "compiler": "torch._inductor.compile_fx" in sys.modules,
    "wandb": "wandb" in sys.modules,
}}))
"""


def probe(tree: Path, kind: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROBE.format(module=MODULES[kind], kind=kind)],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        check=True,
        text=True,
    )
    return orjson.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    trees = {"this tree": Path(__file__).resolve().parent.parent, "baseline": args.baseline.resolve()}
    print("| kind | module | baseline s | this tree s | ratio | modules (baseline → this) | compiler, W&B loaded |")
    print("|---|---|---|---|---|---|---|")
    for kind, module in MODULES.items():
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                runs[name].append(probe(tree, kind))
        median = {name: statistics.median(run["seconds"] for run in results) for name, results in runs.items()}
        last = {name: results[-1] for name, results in runs.items()}
        loaded = ", ".join(
            f"{name}: {'yes' if last[name]['compiler'] else 'no'}/{'yes' if last[name]['wandb'] else 'no'}"
            for name in trees
        )
        print(
            f"| {kind} | `{module}` | {median['baseline']:.2f} | {median['this tree']:.2f} "
            f"| {median['this tree'] / median['baseline']:.2f} "
            f"| {last['baseline']['modules']} → {last['this tree']['modules']} | {loaded} |"
        )


if __name__ == "__main__":
    main()
