"""Run by test_pool_cuda.py in a pooled interpreter that has become it: whether anything the interpreter
imported before its assignment had initialised CUDA, then how many GPUs its assigned
CUDA_VISIBLE_DEVICES shows (a device count cached before the assignment would show the pool's none)."""

import sys

import torch

print(f"cuda initialised: {torch.cuda.is_initialized()}", flush=True)
print(f"devices: {torch.cuda.device_count()}", flush=True)
sys.exit(0)
