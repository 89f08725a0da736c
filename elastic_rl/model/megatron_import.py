"""Imports megatron-core without the parts of its import that elastic-rl never runs.

``import megatron.core`` imports nearly all of megatron-core. Two parts of that are never used
here, and leaving them out makes a trainer's imports about 1 s shorter (5.8 s to 4.6-4.9 s on 2 CPU
cores, docs/benchmarks/recovery.md) and 800 modules smaller:

- megatron's fused kernels (bias-GeLU, SwiGLU, ...) are decorated with ``torch.compile`` when
  their modules load, and that decorator imports torch's dynamo and inductor's compiler. The
  model turns every fusion off (``model/gpt.py``), so the decorated functions never run. They
  are loaded undecorated here, which is what megatron's own ``megatron.core.jit.disable_jit_fuser``
  chooses; it cannot be called earlier, since importing it runs the decorators. (torch's
  optimizer still imports dynamo itself when it is built, 0.5 s of the 2.5 s, but not the compiler.)
- megatron's inference contexts import W&B to log inference statistics. With W&B hidden while
  megatron loads, they take the fallback megatron has for W&B not being installed; a later
  ``import wandb`` (the metrics writer's) loads it as usual.

The trainer package calls this first, so that every trainer process (and erld's pre-imported
trainer interpreters) starts this way; any other importer of megatron gets the whole import,
with the same behaviour.
"""

from __future__ import annotations

import sys

import torch


def _undecorated(model=None, **_options):
    """Stands in for ``torch.compile`` while megatron loads: the function itself, or a decorator returning it."""
    if model is None:
        return lambda function: function
    return model


def import_megatron_core() -> None:
    """Import ``megatron.core`` without compiling its fused kernels or loading W&B; a no-op once imported."""
    if "megatron.core" in sys.modules:
        return
    compile_function = torch.compile
    hide_wandb = "wandb" not in sys.modules
    torch.compile = _undecorated
    if hide_wandb:
        sys.modules["wandb"] = None  # makes `import wandb` raise ImportError
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_function
        if hide_wandb:
            del sys.modules["wandb"]
