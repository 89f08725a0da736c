"""AdamW with its state in host memory (``trainer.optimizer_offload``): the device keeps only the
parameters and their gradients; AdamW's two moments live in host memory and the update runs there.

A step takes one parameter at a time: it copies the parameter and its gradient into two host buffers
(pinned, as large as the largest parameter, reused), runs torch's fused AdamW kernel on them with the
parameter's moments, and copies the updated parameter back. The arithmetic is torch's AdamW's on the
host, so the steps equal those of ``torch.optim.AdamW(fused=True)`` run on host tensors, bit for bit.

The state dict is AdamW's (moments keyed by parameter, the step counter beside them), so a snapshot or a
heal taken with offload loads without it and back. A loaded state goes straight to host memory; it never
passes through the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

HOST = torch.device("cpu")


class HostAdamW(torch.optim.AdamW):
    """torch's AdamW (fused kernel), its moments and its update in host memory."""

    def __init__(self, params: Iterable[torch.nn.Parameter], **settings: Any):
        super().__init__(params, **{**settings, "fused": True})
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("HostAdamW takes no closure")
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)

    def _update(self, param: torch.nn.Parameter, group: dict[str, Any]) -> None:
        state = self.state[param]
        if not state:
            state.update(fresh_state(param))
        weights, gradient = self._host_copies(param)
        beta1, beta2 = group["betas"]
        adamw(
            [weights],
            [gradient],
            [state["exp_avg"]],
            [state["exp_avg_sq"]],
            [],
            [state["step"]],
            fused=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        param.copy_(weights)

    def _host_copies(self, param: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """The parameter and its gradient, copied into this optimizer's host buffers."""
        if param.dtype not in self._buffers:
            same_dtype = [p for group in self.param_groups for p in group["params"] if p.dtype == param.dtype]
            largest = max(p.numel() for p in same_dtype)
            pinned = param.device.type == "cuda"
            self._buffers[param.dtype] = tuple(
                torch.empty(largest, dtype=param.dtype, pin_memory=pinned) for _ in range(2)
            )
        weights, gradient = (buffer[: param.numel()].view(param.shape) for buffer in self._buffers[param.dtype])
        weights.copy_(param)
        gradient.copy_(param.grad)
        return weights, gradient

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's state dict (taken with or without offload), its moments put in host memory. torch's own
        load would first cast them onto each parameter's device."""
        super().load_state_dict({**state_dict, "state": {}})
        saved = state_dict["state"]
        ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for index, param in zip(ids, params):
            if index in saved:
                self.state[param] = {
                    key: value.to(HOST, dtype=torch.float32 if key == "step" else param.dtype, copy=True)
                    for key, value in saved[index].items()
                }


def fresh_state(param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """AdamW's state of ``param`` before its first step, in host memory."""
    return {
        "step": torch.zeros((), dtype=torch.float32),
        "exp_avg": torch.zeros(param.shape, dtype=param.dtype),
        "exp_avg_sq": torch.zeros(param.shape, dtype=param.dtype),
    }
