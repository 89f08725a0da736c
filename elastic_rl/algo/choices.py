"""The algorithm's named choices, as the job spec spells them (kept free of torch so the CLI stays quick)."""

from __future__ import annotations

from enum import Enum


class AlgorithmKind(str, Enum):
    RL = "rl"
    """Policy-gradient RL on the engines' samples and their rewards."""
    SFT = "sft"
    """Supervised fine-tuning: the data's (prompt, response) pairs or chats, the loss on the assistant's tokens."""


class AdvantageEstimator(str, Enum):
    GRPO = "grpo"
    """Each reward against its group's mean and standard deviation; PPO's per-token ratio."""
    GSPO = "gspo"
    """GRPO's advantages with a sequence-level importance ratio, clipped per sequence."""
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    """Returns (reward plus any per-token KL penalty ahead) whitened over the rollout batch."""
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    """REINFORCE++ on rewards minus their group's mean."""


class LossAggregation(str, Enum):
    TOKEN_MEAN = "token_mean"
    """Every response token of the global batch weighs the same."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """Each sequence's token mean, averaged over the global batch's sequences."""
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    """Each sequence's token sum, averaged over the global batch's sequences."""
