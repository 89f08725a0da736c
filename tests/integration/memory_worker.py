"""One trainer rank's memory against `erl plan`'s accounting, started by test_memory_accounting.py.

    python -m tests.integration.memory_worker OUT_FILE SPEC [KEY=VALUE ...]   (RANK, WORLD_SIZE, MASTER_* set)

Builds the spec's model at the spec's tensor-parallel size, as the trainer does, and takes one GRPO step
on a micro-batch of the longest samples the spec allows (every sample the plan's longest, half prompt
and half response) with the trainer's optimizer (in bf16-params megatron's distributed optimizer). Writes, per
rank, the parameters built and accounted,
the bytes the weights, gradients and optimizer state hold on the device and were accounted (and in
host memory, with trainer.optimizer_offload), and the growth of the
process's peak memory from just before the model was built against the accounted total: its resident
memory on a CPU slot, the CUDA allocator's allocations on a GPU slot (`tests/gpu/test_gpu_memory.py`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import orjson
import torch

from checkpoints.rollout_log import RolloutBatch
from elastic_rl import device as process_device
from elastic_rl.memory_plan import plan
from elastic_rl.model.gpt import ModelOptions, init_model_parallel
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.loading import load_spec
from elastic_rl.trainer.grad_norm import gradient_of
from elastic_rl.trainer.grpo import GrpoTrainer
from elastic_rl.trainer.optimizer import build_optimizer, main_weights, scheduled
from policies.devices import DeviceKind, Precision
from tests.trainer_doubles import rollout_batch

# A toy model wide enough that its activations, not the allocator's rounding, make the peak.
WIDER_TOY = [
    "model.hidden_size=512",
    "model.num_layers=4",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=1024",
    "model.max_position_embeddings=512",
    "trainer.micro_batch_size=16",
    "trainer.global_batch_size=64",
]
# SmolLM2 with four samples of 256 tokens: the estimate's score matrices and logits both weigh, and a step
# takes seconds.
SMOLLM2_STEP = [
    "rollout.max_prompt_len=224",
    "rollout.n_samples_per_prompt=4",
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=16",
]


def resident(field: str) -> int:
    """VmRSS or VmHWM (the peak), in bytes."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


class PeakGrowth:
    """How far this process's memory on its device rose above where it stood when made."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
            self.before = resident("VmRSS")

    def bytes(self) -> int:
        return (torch.cuda.max_memory_allocated() if self.cuda else resident("VmHWM")) - self.before


def longest_batch(samples: int, width: int, vocab: int) -> RolloutBatch:
    generator = torch.Generator().manual_seed(5)
    prompts = torch.full((samples,), width // 2)
    responses = torch.full((samples,), width - width // 2)
    return rollout_batch(torch.randint(4, vocab, (samples, width), generator=generator), prompts, responses, generator)


def state_bytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def main() -> None:
    out, spec_path, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    spec = load_spec(spec_path, overrides)
    compute = process_device.assigned()
    init_model_parallel(spec.trainer.tensor_parallel, seed=spec.seed, device=compute)
    planned = plan(spec)
    source = ModelSource.from_spec(spec.model)
    samples = spec.trainer.micro_batch_size
    batch = longest_batch(samples, planned.sequence, source.architecture.vocab_size)

    growth = PeakGrowth(compute.kind is DeviceKind.CUDA)
    model = source.build_policy(ModelOptions(Precision(spec.trainer.dtype)), compute.torch_device)
    optimizer = build_optimizer(model, spec.trainer)
    trainer = GrpoTrainer(spec, model, optimizer, None, None, replica=0)
    context = trainer.prepare(0, batch)
    trainer._shard_loss(context, torch.arange(samples), int(context.mask.sum()), samples, backward=True)
    optimizer.step()
    peak_growth = growth.bytes()

    parameters = list(model.parameters())
    torch_optimizer = scheduled(optimizer)
    moments = [value for state in torch_optimizer.state.values() for value in state.values() if value.dim() > 0]
    if main_weights(optimizer) is not None:
        # The fp32 main weights are the parameters megatron's AdamW updates.
        moments += [p for group in torch_optimizer.param_groups for p in group["params"]]
    # With trainer.optimizer_offload (GPU slots) the moments are in host memory, off the device.
    device_type = torch.device(compute.torch_device).type
    on_device = [moment for moment in moments if moment.device.type == device_type]
    in_host = [moment for moment in moments if moment.device.type != device_type]
    memory = planned.memory
    result = {
        "parameters": sum(p.numel() for p in parameters),
        "accounted_parameters": memory.parameters,
        "state_bytes": state_bytes(parameters) + state_bytes(map(gradient_of, parameters)) + state_bytes(on_device),
        "accounted_state_bytes": memory.parameter_bytes + memory.gradient_bytes + memory.optimizer_bytes,
        "host_state_bytes": state_bytes(in_host),
        "accounted_host_bytes": memory.host_bytes,
        "peak_growth_bytes": peak_growth,
        "accounted_total_bytes": memory.total,
    }
    rank = torch.distributed.get_rank()
    out.with_suffix(f".{rank}.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main()
