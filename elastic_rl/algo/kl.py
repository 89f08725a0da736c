"""Estimators of KL(policy || reference) from per-token log probabilities of sampled tokens.

With ``log_ratio = logp - ref_logp`` for tokens sampled from the policy:
k1 = log_ratio (unbiased, high variance); k2 = log_ratio² / 2; k3 = exp(-log_ratio) - 1 + log_ratio
(unbiased, low variance, always >= 0); low_var_kl = k3 clamped to [-10, 10] for stability.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LOW_VAR_KL_BOUND = 10.0


def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_ratio = ref_logp - logp
    return log_ratio.exp() - 1 - log_ratio


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return k3(logp, ref_logp).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
    "low_var_kl": low_var_kl,
}
