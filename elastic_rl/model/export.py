"""Exports the policy's initial weights as an HF checkpoint: the weights engines start from.

    python -m elastic_rl.model.export examples/tiny-grpo.yaml runs/tiny-grpo/weights/0

Builds the spec's model with megatron-core on one CPU rank (the toy model from
the spec's ``seed``, a pretrained one from its checkpoint), gathers its
canonical state and writes it back in the family's HF layout, as float32,
atomically. An existing folder is left as it is.

In a job, replica 0 of the trainers writes the model it has just built this
way (``write_initial_checkpoint``); erld runs this module only for a job with
no trainer (``debug.rollout_only``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from elastic_rl.errors import SpecError
from elastic_rl.model.convert.hf_import import stored_as_float32
from elastic_rl.model.gpt import destroy_model_parallel, init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.job import JobSpec
from elastic_rl.spec.loading import load_spec


def export_initial_checkpoint(spec: JobSpec, directory: Path) -> int:
    """Write the initial weights to ``directory`` unless it exists; return the parameter count."""
    source = ModelSource.from_spec(spec.model)
    if source.checkpoint is not None and stored_as_float32(source.checkpoint):
        return source.link_as_export(directory)
    # A file, not a port, for the one-rank group: a port chosen here could be one that erld has just
    # handed to a process still starting.
    with tempfile.TemporaryDirectory() as rendezvous:
        init_model_parallel(1, spec.seed, init_method=f"file://{rendezvous}/store")
        try:
            model = source.build_policy()
            write_initial_checkpoint(source, model, directory)
        finally:
            destroy_model_parallel()
    return sum(p.numel() for p in model.parameters())


def write_initial_checkpoint(source: ModelSource, model: torch.nn.Module, directory: Path) -> None:
    """Write ``model``, just built from ``source``, to ``directory`` as the job's initial HF
    checkpoint, unless the folder exists. Every rank of the model's tensor-parallel group calls it
    (the weights are gathered); rank 0 writes."""
    if source.checkpoint is not None and stored_as_float32(source.checkpoint):
        # Import then export is the identity for a float32 checkpoint (tested bit for bit): link its files.
        if torch.distributed.get_rank() == 0 and not directory.exists():
            source.link_as_export(directory)
        return
    weights = full_state_dict(model)
    if torch.distributed.get_rank() == 0 and not directory.exists():
        source.export(directory, weights)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_rl.model.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path, help="job spec (YAML)")
    parser.add_argument("out", type=Path, help="folder to write the HF checkpoint to")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec, args.overrides)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parameters = export_initial_checkpoint(spec, args.out)
    print(f"{args.out}: {parameters:,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
