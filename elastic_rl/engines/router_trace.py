"""What the cpu engine's routers chose in a forward pass: the rows of its routing records.

A transformers mixture of experts (Qwen3-MoE, Mixtral) routes in each MoE
block's ``gate``, a ``...TopKRouter`` whose forward returns (logits, weights,
indices), the indices ``[tokens, topk]`` in the order the router ranked them.
``RouterTrace`` hooks every such router, in layer order, and keeps what each
chose in the forward under way; ``take`` hands the decoder a pass's choices
laid out as its input ``[batch, seq, layers, topk]``, the decoder keeps the
rows of each sequence's real tokens (``elastic_rl.routing_record``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def routers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The model's MoE routers, in layer order; none for a dense model."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


class RouterTrace:
    def __init__(self, model: PreTrainedModel):
        self.chosen: list[torch.Tensor] = []
        for router in routers(model):
            router.register_forward_hook(self._record)

    def _record(self, _router, _inputs, outputs) -> None:
        _, _, indices = outputs
        self.chosen.append(indices.to(torch.int16))

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The choices of the forward just run over ``[batch, seq]`` tokens: ``[batch, seq, layers, topk]``."""
        chosen, self.chosen = self.chosen, []
        return torch.stack([indices.view(batch, seq, -1) for indices in chosen], dim=2)
