"""Lets megatron-core run on machines without CUDA.

megatron-core assumes a GPU in six places that a CPU run reaches:

- ``megatron.core.tensor_parallel.random.get_cuda_rng_tracker``: the tracker that
  forks named RNG streams for dropout and initialisation stores CUDA generator
  states (``torch.cuda.get_rng_state``), which do not exist without CUDA. The
  shim installs ``CpuRngStatesTracker``, the same interface over CPU generator
  states, and seeds it the way ``model_parallel_cuda_manual_seed`` would.
- ``megatron.core.parallel_state.get_global_memory_buffer``: the scratch buffer
  used by local attention and by tensor-parallel gathers allocates on
  ``torch.cuda.current_device()``. The shim replaces the buffer with
  ``CpuGlobalMemoryBuffer``, which allocates on the CPU.
- ``megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb``
  moves the inverse frequencies to ``torch.cuda.current_device()`` on first use.
  The shim replaces it with ``_rotary_embedding_on_cpu``, the same computation
  left on the CPU.
- ``megatron.core.transformer.moe.router.Router.gating`` (a mixture-of-experts
  model's router) moves the router's weight to ``torch.cuda.current_device()``
  on every call. The shim replaces it with ``_router_gating_on_cpu``, the same
  gating left on the CPU.
- ``megatron.core.tensor_parallel.mappings``: the gathers and scatters a
  mixture of experts' token dispatcher runs across tensor-parallel ranks
  allocate their outputs on ``torch.cuda.current_device()``. The shim gives
  that module ``_TorchOnCpu`` for its ``torch``: the same torch, whose
  ``cuda.current_device()`` names the CPU.
- ``megatron.core.tensor_parallel.random``'s activation recomputation
  (``trainer.recompute``) saves the CUDA generator's state beside the CPU's and
  the tracker's before a recomputed piece, and restores it to run it again. The
  shim gives it ``_no_cuda_rng_state`` to save and nothing to restore: on a CPU
  slot the CPU generator and the tracker's CPU states are all there is.

Nothing else is patched for good. ``init_model_parallel`` applies the shim to a
process on a CPU slot only (the device rule, ``policies.devices``), whether or
not the machine has CUDA; a process on a GPU keeps megatron's CUDA paths.

Pipeline parallelism reaches for CUDA in more places, each inside one megatron
call, so ``cuda_calls_on_cpu`` redirects them only while such a call runs:

- ``megatron.core.pipeline_parallel.schedules`` counts a step's tokens in
  ``torch.zeros([], device="cuda")``;
- ``P2PCommunicator._communicate_shapes`` and ``_communicate`` allocate the
  shapes and tensors they receive on ``torch.cuda.current_device()`` and call
  ``torch.cuda.synchronize()`` after a batch of sends and receives (gloo's
  requests are complete once waited, so there is nothing to wait for);
- ``LanguageModule.setup_embeddings_and_output_layer`` moves the last stage's
  copy of a tied embedding to CUDA (``weight.data.cuda()``) before summing it
  with the first stage's.
"""

from __future__ import annotations

import contextlib
import operator
import types
from functools import reduce

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import mappings as tensor_parallel_mappings
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer.moe.moe_utils import router_gating_linear
from megatron.core.transformer.moe.router import Router
from megatron.core.utils import GlobalMemoryBuffer
from torch.overrides import TorchFunctionMode

# Offset megatron adds to the seed of the tensor-parallel stream.
_TENSOR_PARALLEL_SEED_OFFSET = 2718


class CpuRngStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Named RNG streams kept as CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise ValueError(f"rng state {name!r} already exists")
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


class CpuGlobalMemoryBuffer(GlobalMemoryBuffer):
    """megatron's scratch buffer, allocated in CPU memory."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required = reduce(operator.mul, tensor_shape, 1)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required:
            buffer = torch.empty(required, dtype=dtype)
            self.buffer[(name, dtype)] = buffer
        return buffer[:required].view(*tensor_shape)


def _rotary_embedding_on_cpu(self: RotaryEmbedding, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _router_gating_on_cpu(self: Router, input: torch.Tensor) -> torch.Tensor:
    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    return router_gating_linear(input, self.weight, self.bias, router_dtype)


class _CudaOnCpu:
    """``torch.cuda`` as ``_TorchOnCpu`` shows it: the current device is the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"


class _TorchOnCpu(types.ModuleType):
    """torch, but for its ``cuda`` (``_CudaOnCpu``)."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def apply_cpu_shim(seed: int) -> None:
    """Seed megatron's RNG streams as CPU generator states and patch the six CUDA uses.

    Call after ``parallel_state.initialize_model_parallel`` and before building
    the model.
    """
    tracker = CpuRngStatesTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
        seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank,
    )
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuGlobalMemoryBuffer()
    RotaryEmbedding.get_emb = _rotary_embedding_on_cpu
    Router.gating = _router_gating_on_cpu
    tensor_parallel_mappings.torch = _TorchOnCpu("torch")
    megatron_random._get_cuda_rng_state = _no_cuda_rng_state
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None


class _CudaAllocationsOnCpu(TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on the CPU; ``Tensor.cuda()`` leaves a tensor where it is."""

    def __torch_function__(self, func, arg_types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or torch.device(device).type == "cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """While a megatron call that assumes CUDA runs on a CPU slot (see the module's list): its
    allocations on CUDA are made on the CPU, ``torch.cuda.current_device()`` names the CPU and
    ``torch.cuda.synchronize()`` does nothing."""
    current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    try:
        with _CudaAllocationsOnCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = current_device, synchronize
