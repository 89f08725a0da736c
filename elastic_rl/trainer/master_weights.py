"""bf16 parameters with fp32 main weights (``trainer.dtype: bf16-params``): megatron's Float16Module,
DistributedDataParallel and DistributedOptimizer, on GPU slots.

The model is built in fp32, from the seed or a checkpoint, as for any dtype. megatron's Float16Module then
casts it to bf16, and its DistributedDataParallel lays the parameters and their fp32 gradients
(``main_grad``, where its backward hooks add each micro-batch's) out in contiguous buffers. Its
DistributedOptimizer keeps the fp32 main weights and AdamW's moments of this rank's 1/data_parallel of those
buffers; its step updates them, casts them into the bf16 parameters and gathers those over the
data-parallel ranks. The trainer calls the GPTModel inside for its forward passes: Float16Module's own
forward adds only a cast of the logits to fp32, which the log-prob code makes anyway.

The trainer keeps its own step (``trainer.grpo``): it sums megatron's gradient buffers over the
data-parallel ranks and across replicas (torchft), measures and clips their norm, and only then calls the
optimizer, whose own clipping is off. So megatron's gradient sync (a reduce-scatter) is not used: an
all-reduce leaves every rank the whole sum, which the NaN guard and the norm read as they do on the other
paths, at twice a reduce-scatter's traffic inside the replica.

Snapshots take each parameter's whole fp32 main weight and moments under the names an fp32 run saves
(each data-parallel rank fills its range, an all-reduce the rest; at DP=1 the live tensors themselves), so
a snapshot loads at any dtype and data-parallel size. A heal goes rank to rank between replicas of one
layout and carries each rank's shards as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module

from elastic_rl.spec.trainer import TrainerSpec

WHOLE_KEYS = ("weight", "exp_avg", "exp_avg_sq")


class MasterWeights:
    """megatron's distributed optimizer over one rank's bf16 model, as the trainer's optimizer."""

    def __init__(self, model: torch.nn.Module, trainer: TrainerSpec):
        config = model.config  # built for bf16-params: megatron's bf16, over fp32 parameters until cast
        self.wrapped = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=True,
                overlap_grad_reduce=False,
                overlap_param_gather=False,
            ),
            Float16Module(config, model),
        )
        chained = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=trainer.lr,
                weight_decay=trainer.weight_decay,
                adam_beta1=trainer.adam_beta1,
                adam_beta2=trainer.adam_beta2,
                adam_eps=1e-8,  # torch's AdamW default, as the other dtypes use
                clip_grad=0.0,  # the trainer clips, by the norm its NaN guard also reads
                bf16=True,
                params_dtype=torch.bfloat16,
                use_distributed_optimizer=True,
            ),
            [self.wrapped],
            config_overrides={},  # weight decay on every parameter, as torch's AdamW on the other dtypes
            use_gloo_process_groups=False,
        )
        # One model chunk of dense parameters: megatron chains one DistributedOptimizer.
        (self.megatron,) = chained.chained_optimizers if isinstance(chained, ChainedOptimizer) else (chained,)
        self.optimizer = self.megatron.optimizer  # torch's AdamW over the main shards: what the schedule drives
        # Each model parameter this rank holds a range of: its fp32 main shard and the range.
        self.shards: dict[torch.nn.Parameter, tuple[torch.Tensor, slice]] = {}
        for model_group, main_group in zip(
            self.megatron.model_float16_groups, self.megatron.shard_fp32_from_float16_groups
        ):
            for param, main in zip(model_group, main_group):
                owned = self.megatron._get_model_param_range_map(param)["param"]
                self.shards[param] = (main, slice(owned.start, owned.end))
        self.gradient_buffers = [buffer.grad_data for buffer in self.wrapped.buffers]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.wrapped.zero_grad_buffer()

    def clip(self, max_norm: float, norm: torch.Tensor) -> None:
        """Scale the summed gradients as torch's ``clip_grads_with_norm_`` does the other dtypes'."""
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for buffer in self.gradient_buffers:
            buffer.mul_(scale)

    def step(self) -> None:
        self.megatron.step()

    # --- heals: this rank's shards, to the same rank of a peer replica of the same layout ---------------

    def state_dict(self) -> dict[str, Any]:
        """The bf16 parameters travel in the model's own state dict."""
        return {"main": [main for main, _ in self.shards.values()], "adam": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for (main, _), value in zip(self.shards.values(), state["main"]):
            main.copy_(value)
        self.optimizer.load_state_dict(state["adam"])

    # --- snapshots: whole fp32 tensors per parameter --------------------------------------------------

    def has_moments(self) -> bool:
        return any(self.optimizer.state.get(main) for main, _ in self.shards.values())

    @torch.no_grad()
    def whole(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """``param``'s fp32 main weight and, once there are any, AdamW's moments and step, whole (every
        data-parallel rank takes part, for every parameter in the same order). At one data-parallel rank,
        views of the live tensors, as an fp32 snapshot takes them; across several, gathered copies in CPU
        memory, so that a snapshot in flight holds no second copy of the state on the device."""
        moments = self.has_moments()
        keys = WHOLE_KEYS if moments else WHOLE_KEYS[:1]
        if parallel_state.get_data_parallel_world_size() == 1:
            main, _ = self.shards[param]  # the one rank holds every range
            state = self.optimizer.state.get(main, {})
            whole = {key: (main if key == "weight" else state[key]).view_as(param) for key in keys}
            if moments:
                whole["step"] = state["step"]
            return whole
        size = param.numel()
        # Each key's whole tensor, then the sum of the step counters of the ranks holding a range, and
        # how many do: one all-reduce.
        values = torch.zeros(len(keys) * size + 2, dtype=torch.float32, device=param.device)
        if param in self.shards:
            main, owned = self.shards[param]
            state = self.optimizer.state.get(main, {})
            for row, key in enumerate(keys):
                values[row * size : (row + 1) * size][owned] = main if key == "weight" else state[key]
            values[-2] = state["step"] if moments else 0.0
            values[-1] = 1.0
        torch.distributed.all_reduce(values, group=parallel_state.get_data_parallel_group())
        values = values.cpu()
        whole = {key: values[row * size : (row + 1) * size].view_as(param) for row, key in enumerate(keys)}
        if moments:
            whole["step"] = values[-2] / values[-1]
        return whole

    def ensure_moments(self) -> None:
        """Make AdamW's state before a snapshot's is loaded into it, as its first step would."""
        for group in self.optimizer.param_groups:
            for main in group["params"]:
                if not self.optimizer.state.get(main):
                    on_device = group.get("capturable") or group.get("fused")
                    self.optimizer.state[main] = {
                        "step": torch.zeros((), dtype=torch.float32, device=main.device if on_device else "cpu"),
                        "exp_avg": torch.zeros_like(main),
                        "exp_avg_sq": torch.zeros_like(main),
                    }

    @torch.no_grad()
    def load_whole(self, param: torch.nn.Parameter, whole: dict[str, torch.Tensor]) -> None:
        """Take ``param``'s range of the whole tensors ``whole`` (made by ``whole``, then filled)."""
        param.copy_(whole["weight"])
        if param not in self.shards:
            return
        main, owned = self.shards[param]
        main.copy_(whole["weight"].reshape(-1)[owned])
        state = self.optimizer.state[main]
        for key in WHOLE_KEYS[1:]:
            state[key].copy_(whole[key].reshape(-1)[owned])
        state["step"].copy_(whole["step"])
