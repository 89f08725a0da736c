"""Exports a freshly initialised policy as an HF checkpoint: the weights engines start from.

    python -m elastic_rl.model.export examples/tiny-grpo.yaml runs/tiny-grpo/weights/0

Builds the spec's model with megatron-core on one CPU rank (seeded by the spec's
``seed``), gathers its canonical state and writes it with the architecture's
converter, atomically. An existing folder is left as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elastic_rl.config import JobSpec, load_spec
from elastic_rl.errors import SpecError
from elastic_rl.model.convert import export_hf
from elastic_rl.model.gpt import build_gpt, destroy_model_parallel, init_model_parallel
from elastic_rl.model.megatron_state import full_state_dict
from elastic_rl.model.tokenizer import load_tokenizer, padded_vocab_size
from elastic_rl.net import free_port


def export_initial_checkpoint(spec: JobSpec, directory: Path) -> int:
    """Write the initial weights to ``directory`` unless it exists; return the parameter count."""
    tokenizer = load_tokenizer(spec.model.tokenizer)
    vocab_size = padded_vocab_size(tokenizer)
    init_model_parallel(1, spec.seed, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        model = build_gpt(spec.model, vocab_size)
        parameters = sum(p.numel() for p in model.parameters())
        if not directory.exists():
            export_hf(directory, full_state_dict(model), spec.model, vocab_size, tokenizer)
    finally:
        destroy_model_parallel()
    return parameters


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
    print(f"{args.out}: {spec.model.architecture} model, {parameters:,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
