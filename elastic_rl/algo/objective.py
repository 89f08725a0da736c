"""The per-token loss of one micro-batch, as the job's algorithm spec composes it.

The trainer hands over log probs (its own now, its own before the rollout's first step, the
engine's, the reference's) and advantages; this chooses the ratio (per token, or per sequence
for GSPO), masks off-policy sequences (OPSM) and applies TIS when asked, and adds the entropy
bonus and the KL term (unless the KL is already in the reward). For SFT the loss is the negative
log-likelihood of each response token. Pure: the trainer owns the model, the batch and the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_rl.algo.kl import KL_ESTIMATORS
from elastic_rl.algo.losses import (
    gspo_clipped_loss,
    off_policy_sequence_mask,
    policy_token_loss,
    ppo_clipped_loss,
    tis_weights,
)
from elastic_rl.spec.algorithm import AdvantageEstimator, AlgorithmKind, AlgorithmSpec


@dataclass(frozen=True)
class TokenLosses:
    loss: torch.Tensor
    """What is aggregated and back-propagated."""
    pg: torch.Tensor
    """The policy-gradient term per token (for SFT: the negative log-likelihood)."""
    clipped: torch.Tensor
    kl: torch.Tensor | None
    """KL to the reference per token (reported; in the loss only when it is not in the reward)."""
    tis_weight: torch.Tensor | None
    """The truncated importance weight per token, when TIS is on (reported)."""
    opsm_masked: torch.Tensor | None = None
    """1 at each token OPSM kept out of the policy gradient, when it is on (reported)."""


def token_losses(
    algorithm: AlgorithmSpec,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    old_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> TokenLosses:
    if algorithm.kind is AlgorithmKind.SFT:
        nll = -logp
        return TokenLosses(nll, nll, torch.zeros_like(logp), None, None)
    if algorithm.advantage_estimator is AdvantageEstimator.GSPO:
        pg, clipped = gspo_clipped_loss(logp, old_logp, advantages, mask, algorithm.eps_clip, algorithm.eps_clip_high)
    else:
        pg, clipped = ppo_clipped_loss(logp, old_logp, advantages, algorithm.eps_clip, algorithm.eps_clip_high)
    opsm_masked = None
    if algorithm.opsm:
        opsm_masked = off_policy_sequence_mask(logp, old_logp, advantages, mask, algorithm.opsm_delta)
        pg = pg * (1 - opsm_masked)
    tis_weight = None
    if algorithm.tis_cap is not None:
        tis_weight = tis_weights(old_logp, engine_logp, algorithm.tis_cap)
        pg = pg * tis_weight
    kl = None if ref_logp is None else KL_ESTIMATORS[algorithm.kl_estimator](logp, ref_logp)
    kl_term = None if algorithm.kl_in_reward else kl
    loss = policy_token_loss(pg, entropy, kl_term, algorithm.entropy_coef, algorithm.kl_coef)
    return TokenLosses(loss, pg, clipped, kl, tis_weight, opsm_masked)
