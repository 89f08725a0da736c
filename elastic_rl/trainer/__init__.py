"""The trainer process: a Megatron model replica under a torchft Manager, learning from committed rollouts."""
