"""Run by test_pool_cuda.py in a pooled interpreter that has become it: whether anything the interpreter
imported before its assignment had initialised CUDA, then whether the GPU its assigned CUDA_VISIBLE_DEVICES
names is there and takes a tensor (a driver initialised before the assignment, under the pool's "", finds
none; a device count cached then would show none)."""

import sys

import torch

print(f"cuda initialised: {torch.cuda.is_initialized()}", flush=True)
print(f"available: {torch.cuda.is_available()}", flush=True)
print(f"devices: {torch.cuda.device_count()}", flush=True)
print(f"on the GPU: {torch.ones(3, device='cuda').sum().item() == 3.0}", flush=True)
sys.exit(0)
