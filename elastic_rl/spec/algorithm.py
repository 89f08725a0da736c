"""The ``algorithm`` section: the objective (RL or SFT) and its named choices.

The choices are plain enums, free of torch, so the CLI stays quick; ``elastic_rl.algo`` implements them."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveFloat, ValidationInfo, field_validator, model_validator

from elastic_rl.spec.base import Component, existing_checkpoint
from elastic_rl.spec.engines import TeacherEnginesSpec
from elastic_rl.spec.trainer import TrainerSpec


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
    PPO = "ppo"
    """GAE over a critic's values (``algorithm.critic``), whitened over the rollout batch."""


class LossAggregation(str, Enum):
    TOKEN_MEAN = "token_mean"
    """Every response token of the global batch weighs the same."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """Each sequence's token mean, averaged over the global batch's sequences."""
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    """Each sequence's token sum, averaged over the global batch's sequences."""
    ROLLOUT_TOKEN_MEAN = "rollout_token_mean"
    """The step's token sum over the rollout's mean tokens per step (its response tokens over its steps):
    every token of the rollout weighs the same, whichever step trains it (TRL's default, `dapo`)."""


class DistillationSpec(Component):
    """On-policy distillation from a teacher the trainer holds (slime's --use-opd --opd-type megatron) or
    engines of its own serve (--opd-type sglang)."""

    teacher: Path
    """An HF checkpoint with the policy's tokenizer (`erl validate` checks it). Held in the trainer, frozen
    like the KL reference, it must also have the policy's architecture; served by engines, any causal LM."""
    engines: TeacherEnginesSpec | None = None
    """Serve the teacher on engines of its own, which score each sample's response once, before its
    rollout is committed: its log probs are committed with the rollout. Unset: the trainer holds it."""
    coef: PositiveFloat = 1.0
    """Each response token's advantage is lowered by this times the reverse KL to the teacher at the token:
    the student's log prob minus the teacher's (slime's --opd-kl-coef)."""

    _teacher_exists = field_validator("teacher")(existing_checkpoint)


class CriticSpec(Component):
    """PPO's value model, trained beside the policy in the same replicas (slime's critic)."""

    hf_checkpoint: Path | None = None
    """An HF checkpoint of the policy's architecture to start the critic's body from; unset, the policy's
    initial weights. Its value head (hidden size to one scalar) always starts at zero."""
    lr: PositiveFloat | None = None
    """The critic's peak learning rate (slime's --critic-lr); unset, trainer.lr. Its schedule has the
    policy's shape: a linear warmup, then trainer.lr_decay down to trainer.min_lr."""
    lr_warmup_steps: int | None = Field(None, ge=0)
    """Optimizer steps of the critic's linear warmup (slime's --critic-lr-warmup-iters); unset,
    trainer.warmup_steps."""
    value_clip: PositiveFloat = 0.2
    """A value may move at most this far from the rollout's old value before its loss stops pulling it
    (the larger of the clipped and unclipped squared errors is taken; slime's --value-clip)."""
    warmup_rollouts: int = Field(0, ge=0)
    """Rollouts in which only the critic learns and the policy holds still (slime's --num-critic-only-steps)."""

    _checkpoint_exists = field_validator("hf_checkpoint")(existing_checkpoint)

    def as_trainer(self, policy: TrainerSpec) -> TrainerSpec:
        """The policy's optimizer and schedule settings with the critic's learning rate and warmup."""
        update: dict[str, float | int] = {}
        if self.lr is not None:
            update["lr"] = self.lr
        if self.lr_warmup_steps is not None:
            update["warmup_steps"] = self.lr_warmup_steps
        return policy.model_copy(update=update)


class AlgorithmSpec(Component):
    """The objective: RL (an advantage estimator, asymmetric PPO clipping, optional TIS, OPSM, KL and
    entropy terms) or SFT."""

    kind: AlgorithmKind = AlgorithmKind.RL
    """`rl`, or `sft`: train on the data's (prompt, response) pairs (the response from
    `data.label_key`) or chats (`data.messages_key`), the loss on the assistant's tokens only,
    aggregated by loss_aggregation; the estimator, clipping, TIS, KL and entropy fields are unused."""
    advantage_estimator: AdvantageEstimator = AdvantageEstimator.GRPO
    """`grpo`, `gspo` (GRPO's advantages, a sequence-level ratio clipped per sequence),
    `reinforce_plus_plus` (returns whitened over the rollout batch) or
    `reinforce_plus_plus_baseline` (the same on rewards minus their group's mean) or `ppo` (GAE over
    the values of algorithm.critic, which it needs)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """`ppo`: the discount per token in GAE (slime's --gamma)."""
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0)
    """`ppo`: GAE's lambda, from 0 (one-step TD errors) to 1 (the whole return less the value; slime's --lambd)."""
    critic: CriticSpec | None = None
    """`ppo`'s value model, with its defaults when the section is left out; only with advantage_estimator ppo."""
    loss_aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    """How per-token losses become the step's loss: `token_mean` over the global batch's tokens,
    `seq_mean_token_mean` / `seq_mean_token_sum` over its sequences, or `rollout_token_mean` over the
    rollout's mean tokens per step."""
    tis_cap: PositiveFloat | None = None
    """Truncated importance sampling: weight each token's policy loss by the trainer's over the
    engine's probability of it, capped at this; unset turns TIS off."""
    eps_clip: PositiveFloat = 0.2
    """Lower PPO clip: the ratio is kept above 1 - eps_clip."""
    eps_clip_high: PositiveFloat = 0.28
    """Upper PPO clip: the ratio is kept below 1 + eps_clip_high."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference model; 0 disables the reference."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """Estimator of KL(policy || reference)."""
    kl_in_reward: bool = False
    """Subtract the KL penalty from the reward (per token for REINFORCE++, per sequence otherwise)
    instead of adding it to the loss; needs kl_coef > 0."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus (entropy is always logged)."""
    normalize_advantages_by_std: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    advantage_std_epsilon: PositiveFloat = 1e-6
    """Added to a group's standard deviation before dividing by it (slime's 1e-6; TRL's is 1e-4)."""
    use_rollout_logprobs: bool = False
    """Take the engines' log probs as the old policy's (slime's --use-rollout-logprobs), instead of the
    trainers' own pass over the rollout before its first step: that pass is saved (a forward over every
    sample). Where the engines compute as the trainer does (fp32 on CPU slots, sync mode) the two agree
    to float rounding; elsewhere the old policy becomes the one that sampled. Not with tis_cap, whose
    weight would always be 1."""
    opsm: bool = False
    """Off-policy sequence masking (slime's --use-opsm): a token with a negative advantage, in a sequence
    whose mean log prob has fallen by more than opsm_delta since the old policy (its response tokens' mean
    of old minus current), contributes no policy gradient. Works with every estimator, TIS and
    aggregation; the masked share is train/opsm_masked_fraction."""
    opsm_delta: PositiveFloat = 1e-4
    """OPSM's threshold on a sequence's mean log-prob drift (slime's --opsm-delta default)."""
    routing_replay: bool = False
    """A mixture of experts' rollout routing replay (slime's --use-rollout-routing-replay): the engines return
    the experts each token was routed to, the routing is committed with the rollout, and the trainer's
    old-policy, reference and training passes route each token as the engine did. Not for a dense model
    or kind sft; train/routing_agreement is the share of (token, layer) routings the trainer would have
    chosen itself."""
    distillation: DistillationSpec | None = None
    """On-policy distillation from a teacher checkpoint, on top of any estimator; unset turns it off."""
    reference: str = "initial"
    """The KL reference policy: `initial` (the policy's starting weights) or the path of an HF
    checkpoint of the same architecture."""

    @model_validator(mode="after")
    def _tis_needs_the_trainers_old_policy(self) -> AlgorithmSpec:
        if self.use_rollout_logprobs and self.tis_cap is not None:
            raise ValueError(
                "tis_cap weighs the trainer's old policy against the engine's, which use_rollout_logprobs makes the "
                "same: drop one"
            )
        return self

    @model_validator(mode="after")
    def _sft_has_no_reference(self) -> AlgorithmSpec:
        if self.kind is AlgorithmKind.SFT and self.kl_coef > 0:
            raise ValueError("kind sft trains on the data alone: set kl_coef to 0 (SFT has no reference policy)")
        return self

    @model_validator(mode="after")
    def _sft_has_no_sequences_to_mask(self) -> AlgorithmSpec:
        if self.kind is AlgorithmKind.SFT and self.opsm:
            raise ValueError("opsm masks policy-gradient tokens, which kind sft has none of: drop opsm")
        return self

    @model_validator(mode="after")
    def _sft_has_no_routing_to_replay(self) -> AlgorithmSpec:
        if self.kind is AlgorithmKind.SFT and self.routing_replay:
            raise ValueError("routing_replay replays what the engines generated, which kind sft has none of: drop it")
        return self

    @model_validator(mode="after")
    def _sft_has_no_advantages_to_distil(self) -> AlgorithmSpec:
        if self.kind is AlgorithmKind.SFT and self.distillation is not None:
            raise ValueError("distillation changes advantages, which kind sft has none of: drop distillation")
        return self

    @model_validator(mode="before")
    @classmethod
    def _ppo_has_a_critic(cls, data: Any) -> Any:
        """``ppo`` without a critic section takes the critic's defaults."""
        if isinstance(data, dict) and data.get("advantage_estimator") in ("ppo", AdvantageEstimator.PPO):
            return {"critic": {}, **data}
        return data

    @model_validator(mode="after")
    def _only_ppo_has_a_critic(self) -> AlgorithmSpec:
        ppo = self.kind is AlgorithmKind.RL and self.advantage_estimator is AdvantageEstimator.PPO
        if self.critic is not None and not ppo:
            raise ValueError(
                "algorithm.critic is trained for advantage_estimator ppo (of kind rl) only: set it, or drop the critic"
            )
        return self

    @property
    def frozen_models(self) -> int:
        """The models the trainer holds for their log probs alone: the KL reference, the teacher."""
        return int(self.kl_coef > 0) + int(self.distillation is not None and self.distillation.engines is None)

    @model_validator(mode="after")
    def _kl_in_reward_needs_a_coefficient(self) -> AlgorithmSpec:
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("kl_in_reward needs kl_coef > 0 (with kl_coef 0 there is no KL to subtract)")
        return self

    @field_validator("reference")
    @classmethod
    def _reference_checkpoint(cls, value: str, info: ValidationInfo) -> str:
        if value == "initial":
            return value
        return str(existing_checkpoint(Path(value), info))
