"""The trainer process: a Megatron model replica under a torchft Manager, learning from committed rollouts."""

from elastic_rl.model.megatron_import import import_megatron_core

# Before any trainer module imports megatron: the trainer starts about 1 s sooner (model/megatron_import.py).
import_megatron_core()
