"""One optimizer step of the policy-gradient objective under torchft, with the NaN/Inf guard.

A rollout batch is trained in ``samples / global_batch_size`` steps. Each
step's global batch is split by that step's quorum (participant i of n takes
shard i), and a replica's shard by its data-parallel ranks; the loss is
normalised by the global batch (its response tokens or its samples,
``algorithm.loss_aggregation``), and gradients are summed inside the replica
and then across replicas, so the gradient does not depend on how many
replicas or ranks took part. The same all-reduce carries each
replica's verdict on its own shard (finite or not) and the metric sums, so
every replica sees the same step and reaches the same NaN/Inf response
(``policies.nan_guard``). The step is taken only if the Manager commits.
With pipeline stages megatron's schedule runs the micro-batches
(``model.pipeline``): the last stage scores them, and its metric sums and log
probabilities are summed over the stages, so that every stage holds the same
rollout state and reaches the same verdict.
A rollout's tensors live on the model's device, so every collective runs on
tensors of its group's device (gloo on CPU, NCCL on a GPU).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from checkpoints.rollout_log import RolloutBatch, committed_teacher_logprobs
from elastic_rl.algo.advantages import distilled, explained_variance, gae, token_advantages
from elastic_rl.algo.kl import KL_ESTIMATORS
from elastic_rl.algo.losses import aggregate, loss_tokens, ppo_kl, reduce_global
from elastic_rl.algo.objective import token_losses
from elastic_rl.layer_names import is_split_over_experts, summed_over_tensor_ranks
from elastic_rl.model.expert_load import ExpertLoad
from elastic_rl.model.pipeline import (
    largest_over_stages,
    micro_batches_over_expert_ranks,
    run_micro_batches,
    sum_over_stages,
)
from elastic_rl.model.routing_replay import RoutingReplay
from elastic_rl.model.token_scores import Entropy
from elastic_rl.spec.algorithm import AdvantageEstimator, AlgorithmKind
from elastic_rl.spec.job import JobSpec
from elastic_rl.trainer.critic import Critic
from elastic_rl.trainer.grad_norm import grad_norm, gradient_of
from elastic_rl.trainer.gradient_buffer import view_gradients
from elastic_rl.trainer.master_weights import MasterWeights
from elastic_rl.trainer.micro_batches import MicroBatch, fixed_micro_batches, token_budget_micro_batches
from policies.nan_guard import Decision, Response, StepHealth, decide, needs_recompute_elsewhere
from policies.straggler import StragglerVerdict, judge, peer_ratios

# Sums over the step's samples, all-reduced across replicas; samples_per_step proves the global batch was whole.
METRIC_NAMES = (
    "loss",
    "pg_loss",
    "ppo_kl",
    "entropy",
    "clipfrac",
    "kl",
    "samples_per_step",
    "tis_weight_mean",
    "tis_clipped_fraction",
    "opsm_masked_fraction",
    "value_loss",
    "value_clipfrac",
)
# Reported only with algorithm.tis_cap: the mean TIS weight, and the share of tokens whose weight is the cap.
TIS_ONLY = ("tis_weight_mean", "tis_clipped_fraction")
# Reported only with algorithm.opsm: the share of tokens it kept out of the policy gradient.
OPSM_ONLY = ("opsm_masked_fraction",)
# Reported only with a critic (advantage_estimator ppo).
CRITIC_ONLY = ("value_loss", "value_clipfrac", "critic_grad_norm")
# Meaningless for SFT, which has no old policy, clipping or reference; its loss is the NLL.
POLICY_GRADIENT_ONLY = ("pg_loss", "ppo_kl", "first_step_ppo_kl", "clipfrac", "kl", *TIS_ONLY, *OPSM_ONLY)


def all_finite(values: torch.Tensor) -> bool:
    """Whether every element is finite. A sum is finite only if every term is (an inf or a NaN
    stays in it), so one cheap pass answers; only a sum that overflowed needs the exact test, which
    on a 135M-parameter model's gradients takes half a second on two cores."""
    return bool(values.sum().isfinite()) or bool(values.isfinite().all())


class NonFiniteStep(RuntimeError):
    """Reported to the Manager so that the step is not committed."""


@dataclass
class StepMetrics:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, **named: float) -> None:
        for name, value in named.items():
            self.values.setdefault(name, []).append(float(value))

    def means(self) -> dict[str, float]:
        return {name: sum(v) / len(v) for name, v in self.values.items()}


@dataclass(frozen=True)
class LogprobGap:
    """Largest |trainer - engine| log prob over a rollout's response tokens: of every sample, and of the
    samples the weights the trainer holds generated (``on_policy``; None where none did: async mode, or
    only groups buffered from an earlier rollout). Only the latter is deterministic mode's to bound: the
    rest were generated by earlier weights."""

    every: float
    on_policy: float | None

    @classmethod
    def of(cls, logp: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, on_policy: torch.Tensor) -> LogprobGap:
        """``on_policy``: which rows (samples) the trainer's weights generated."""
        gap = (logp - engine).abs() * mask
        return cls(gap.max().item(), gap[on_policy].max().item() if bool(on_policy.any()) else None)

    def merged(self, other: LogprobGap | None) -> LogprobGap:
        if other is None:
            return self
        mine = [value for value in (self.on_policy, other.on_policy) if value is not None]
        return LogprobGap(max(self.every, other.every), max(mine) if mine else None)

    def over_stages(self, device: torch.device) -> LogprobGap:
        """The largest of each stage's (the last stage's, where only it measured)."""
        on_policy = largest_over_stages(-math.inf if self.on_policy is None else self.on_policy, device)
        return LogprobGap(largest_over_stages(self.every, device), None if on_policy == -math.inf else on_policy)


@dataclass
class RolloutContext:
    """What every step of one rollout shares; a healing replica takes it from its peer."""

    rollout_id: int
    batch: RolloutBatch
    mask: torch.Tensor
    token_advantages: torch.Tensor
    old_logp: torch.Tensor
    """The policy's log probs before the rollout's first step: PPO's "old" policy."""
    ref_logp: torch.Tensor | None
    logprob_gap: LogprobGap | None
    """None for SFT, and until measured (by the first step, with algorithm.use_rollout_logprobs)."""
    ref_gap: float | None
    """Largest |reference - policy| log prob over the response tokens; 0 on rollout 0."""
    distillation_kl: float | None = None
    """With algorithm.distillation: the mean over response tokens of the student's log prob minus the
    teacher's (the reverse KL the advantages paid)."""
    old_values: torch.Tensor | None = None
    """With a critic (ppo): its values before the rollout's first step, which GAE took."""
    returns: torch.Tensor | None = None
    """With a critic: what its values are trained toward (GAE's advantages before whitening, plus the values)."""
    explained_variance: float | None = None
    """With a critic: how much of the returns' variance its old values explained."""
    metrics: StepMetrics = field(default_factory=StepMetrics)
    started: float = field(default_factory=time.monotonic)
    prepare_time: float = 0.0
    """Seconds ``prepare`` took: the rollout's old-policy, reference and teacher passes (for SFT, or with
    algorithm.use_rollout_logprobs and no reference, little more than the batch's move to the device)."""

    def heal_state(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "old_logp": self.old_logp,
            "old_values": self.old_values,
            "logprob_gap": None if self.logprob_gap is None else asdict(self.logprob_gap),
            "metrics": self.metrics.values,
        }


@dataclass(frozen=True)
class StepOutcome:
    committed: bool
    decision: Decision
    leader: bool
    """This replica was participant 0 of the step: it exports and snapshots for the job."""
    straggling: StragglerVerdict | None = None
    """A committed step's straggler verdict (every replica reaches the same)."""


class GrpoTrainer:
    def __init__(
        self,
        spec: JobSpec,
        model,
        optimizer,
        scheduler,
        manager,
        replica: int,
        reference=None,
        before_optimizer_step=None,
        teacher=None,
        critic: Critic | None = None,
    ):
        self.spec = spec
        # Called before each optimizer step, which changes the state a snapshot may still be copying;
        # returns the seconds it blocked.
        self.before_optimizer_step = before_optimizer_step or (lambda: 0.0)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.manager = manager
        self.replica = replica
        self.reference = reference
        self.teacher = teacher
        """With algorithm.distillation: the frozen teacher, scored like the reference."""
        self.critic = critic
        """With advantage_estimator ppo: the critic, trained in the same steps."""
        # A rank's own experts first: their gradients are summed over other ranks than the rest's.
        trained = [p for p in model.parameters() if p.requires_grad]
        self.parameters = sorted(trained, key=lambda p: not is_split_over_experts(p))
        self.expert_gradient_size = sum(p.numel() for p in self.parameters if is_split_over_experts(p))
        tensor_ranks = parallel_state.get_tensor_model_parallel_world_size()
        self.summed_over_tensor_ranks = summed_over_tensor_ranks(model, tensor_ranks)
        """Parameters each tensor-parallel rank holds whole and computes a share of the gradient of."""
        self.device = self.parameters[0].device
        self.consecutive_skips = 0
        self.straggler_streaks: dict[int, int] = {}  # replica -> its slow committed steps in a row
        # bf16 parameters: their gradients add up in megatron's fp32 buffers, summed beside the flat one.
        self.master = optimizer if isinstance(optimizer, MasterWeights) else None
        self.gradient_buffers = self.master.gradient_buffers if self.master is not None else []
        self.reduced, self.gradient_size = self._all_reduce_buffer(spec.trainer.replicas.max)
        # The replica's data-parallel ranks split its part of each step; none apart from this one at 1.
        self.data_ranks = spec.trainer.data_parallel
        self.data_rank = parallel_state.get_data_parallel_rank() if self.data_ranks > 1 else 0
        # Context parallelism: each of these ranks holds a share of every sample (``model.context_parallel``).
        self.context_ranks = spec.trainer.context_parallel
        self.context_rank = parallel_state.get_context_parallel_rank() if self.context_ranks > 1 else 0
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.expert_load = ExpertLoad.of(model)  # a mixture of experts' routers; None for a dense model
        self.routing_replay = None
        if spec.algorithm.routing_replay:
            self.routing_replay = RoutingReplay.attach(model)
            if reference is not None:
                RoutingReplay.attach(reference)

    def _all_reduce_buffer(self, replicas: int) -> tuple[torch.Tensor, int]:
        """What one step all-reduces, in one tensor: every gradient, then the metric sums, then per replica
        slot its verdict, its shard and its time. Each parameter's ``.grad`` is a view of its part, so the backward
        pass accumulates straight into it and nothing is copied in or out (a copy each way of the whole
        gradient, 0.3 s a step on SmolLM2 here). With bf16 parameters the gradients are megatron's
        buffers instead, and this one holds the rest."""
        size = sum(p.numel() for p in self.parameters) if self.master is None else 0
        reduced = torch.zeros(size + len(METRIC_NAMES) + 3 * replicas, device=self.device)
        if self.master is None:
            view_gradients(self.parameters, reduced)
        return reduced, size

    def move_gradients(self, where: torch.device) -> None:
        """Move the step's buffers (the policy's and the critic's) to ``where``, their views with them
        (colocated mode's handover): the backward pass then accumulates into the buffers the step sums."""
        self.reduced = self.reduced.to(where)
        if self.master is None:
            view_gradients(self.parameters, self.reduced)
        if self.critic is not None:
            self.critic.move_gradients(where)

    def _micro_batches(self, batch: RolloutBatch, rows: torch.Tensor, scale: int = 1) -> list[MicroBatch]:
        """``rows`` cut into micro-batches of ``scale`` times the configured size (or token budget)."""
        trainer = self.spec.trainer
        lengths = (batch.prompt_lengths + batch.response_lengths).cpu()
        if trainer.max_tokens_per_micro_batch is None:
            groups = fixed_micro_batches(rows, trainer.micro_batch_size * scale)
        else:
            groups = token_budget_micro_batches(
                rows, lengths, trainer.max_tokens_per_micro_batch * scale, packed=trainer.packing
            )
        micro_batches = [MicroBatch.of(batch, group, trainer.packing) for group in groups]
        if self.context_ranks == 1:
            return micro_batches
        # With sequence parallelism a rank's share splits over the tensor-parallel ranks.
        multiple = trainer.tensor_parallel if trainer.sequence_parallel else 1
        return [
            replace(mb, model_input=mb.model_input.split_over_context(self.context_rank, self.context_ranks, multiple))
            for mb in micro_batches
        ]

    @torch.no_grad()
    def _log_probs(self, model, batch: RolloutBatch) -> torch.Tensor:
        logp = torch.zeros(batch.tokens.shape, device=batch.tokens.device)
        temperature = self.spec.rollout.temperature
        # Without a backward pass to keep activations for, a micro-batch of twice the size fits the
        # memory the training micro-batches were sized for, and runs faster (6.5 s against 7.1 s for
        # SmolLM2's 64 samples here).
        micro_batches = self._micro_batches(batch, torch.arange(batch.size), scale=2)

        def score(index: int, hidden: torch.Tensor) -> torch.Tensor:
            mb = micro_batches[index]
            logp[mb.cut], _ = mb.scores(model, hidden, temperature, Entropy.NONE)
            return hidden.new_zeros(())

        run_micro_batches(model, [mb.model_input for mb in micro_batches], score, backward=False)
        sum_over_stages(logp)  # the last stage's, on every stage
        return logp

    def prepare(self, rollout_id: int, batch: RolloutBatch, healed: dict[str, Any] | None = None) -> RolloutContext:
        """The rollout's shared state on the model's device, from the current weights, or from a peer
        mid-rollout."""
        started = time.monotonic()
        batch = batch.to(self.device)
        mask = batch.loss_mask
        if self.spec.algorithm.kind is AlgorithmKind.SFT:
            # The data's NLL needs no old policy, engine log probs or advantages.
            zeros = torch.zeros(batch.tokens.shape, device=self.device)
            context = RolloutContext(rollout_id, batch, mask, zeros, zeros, None, None, None)
        else:
            context = self._policy_gradient_context(rollout_id, batch, mask, healed)
        if healed is not None:
            context.metrics.values = {name: list(values) for name, values in healed["metrics"].items()}
        context.prepare_time = time.monotonic() - started
        return context

    def _policy_gradient_context(
        self, rollout_id: int, batch: RolloutBatch, mask: torch.Tensor, healed: dict[str, Any] | None
    ) -> RolloutContext:
        algorithm = self.spec.algorithm
        ref_logp = self._log_probs(self.reference, batch) if self.reference is not None else None
        if healed is not None:
            old_logp, gap = healed["old_logp"], healed["logprob_gap"] and LogprobGap(**healed["logprob_gap"])
        elif algorithm.use_rollout_logprobs:
            # No pass of its own: the trainer's log probs are first computed by the rollout's first step,
            # which measures the gap to the engine's on its samples (in _shard_loss).
            old_logp, gap = batch.engine_logprobs, None
        else:
            with self._counting_agreement():
                old_logp = self._log_probs(self.model, batch)
            gap = LogprobGap.of(old_logp, batch.engine_logprobs, mask, self._on_policy(rollout_id, batch))
        ref_gap = None if ref_logp is None else ((ref_logp - old_logp).abs() * mask).max().item()
        # KL in the reward is the rollout's policy against the reference, fixed for all its steps.
        token_kl = KL_ESTIMATORS[algorithm.kl_estimator](old_logp, ref_logp) if algorithm.kl_in_reward else None
        critic_fields = {}
        if algorithm.advantage_estimator is AdvantageEstimator.PPO:
            if healed is not None:
                old_values = healed["old_values"]
            else:
                micro_batches = self._micro_batches(batch, torch.arange(batch.size), scale=2)
                old_values = self.critic.values(micro_batches, batch.tokens.shape, self.device)
            estimate = gae(
                batch.rewards, old_values, mask, algorithm.gamma, algorithm.gae_lambda, token_kl, algorithm.kl_coef
            )
            advantages = estimate.advantages
            critic_fields = {
                "old_values": old_values,
                "returns": estimate.returns,
                "explained_variance": explained_variance(old_values, estimate.returns, mask),
            }
        else:
            advantages = token_advantages(
                algorithm.advantage_estimator,
                batch.rewards,
                mask,
                self.spec.rollout.n_samples_per_prompt,
                algorithm.normalize_advantages_by_std,
                token_kl,
                algorithm.kl_coef,
                algorithm.advantage_std_epsilon,
            )
        distillation_kl = None
        if algorithm.distillation is not None:
            teacher_logp = self._teacher_log_probs(rollout_id, batch)
            advantages = distilled(advantages, old_logp, teacher_logp, mask, algorithm.distillation.coef)
            distillation_kl = (((old_logp - teacher_logp) * mask).sum() / mask.sum().clamp(min=1)).item()
        return RolloutContext(
            rollout_id,
            batch,
            mask,
            advantages,
            old_logp,
            ref_logp,
            gap,
            ref_gap,
            distillation_kl=distillation_kl,
            **critic_fields,
        )

    def _teacher_log_probs(self, rollout_id: int, batch: RolloutBatch) -> torch.Tensor:
        """The teacher's log probs of the batch's tokens: from the teacher the trainer holds, or as its engines
        scored them before the rollout was committed."""
        if self.teacher is not None:
            return self._log_probs(self.teacher, batch)
        return committed_teacher_logprobs(batch, rollout_id)

    def _critic_only(self, ctx: RolloutContext) -> bool:
        """In the critic's warmup rollouts the policy holds still."""
        return self.critic is not None and ctx.rollout_id < self.critic.settings.warmup_rollouts

    def _shard_loss(
        self,
        ctx: RolloutContext,
        rows: torch.Tensor,
        global_tokens: int,
        global_samples: int,
        backward: bool,
        measure_gap: bool = False,
    ) -> torch.Tensor:
        """Forward (and backward) over ``rows``; returns the metric sums in METRIC_NAMES order. ``measure_gap``:
        the rollout's first step with algorithm.use_rollout_logprobs, whose forward is the first on the rollout's
        weights: it records the trainer's gap to the engine's log probs (on the step's samples)."""
        spec = self.spec
        sums = torch.zeros(len(METRIC_NAMES))
        how = spec.algorithm.loss_aggregation
        steps = spec.rollout.samples_per_rollout // spec.trainer.global_batch_size
        normaliser = loss_tokens(how, global_tokens, int(ctx.mask.sum().item()), steps)
        # Without an entropy bonus the entropy is a metric: no gradient for it.
        entropy = Entropy.LOSS if spec.algorithm.entropy_coef > 0 else Entropy.METRIC
        micro_batches = self._micro_batches(ctx.batch, rows)

        def score(index: int, hidden: torch.Tensor) -> torch.Tensor:
            mb = micro_batches[index]
            cut = mb.cut
            m = ctx.mask[cut]
            logp, ent = mb.scores(self.model, hidden, spec.rollout.temperature, entropy)
            if measure_gap:
                on_policy = self._on_policy(ctx.rollout_id, ctx.batch)[mb.rows]
                gap = LogprobGap.of(logp.detach(), ctx.batch.engine_logprobs[cut], m, on_policy)
                ctx.logprob_gap = gap.merged(ctx.logprob_gap)
            ref_logp = None if ctx.ref_logp is None else ctx.ref_logp[cut]
            terms = token_losses(
                spec.algorithm,
                logp,
                ent,
                ctx.old_logp[cut],
                ctx.batch.engine_logprobs[cut],
                ref_logp,
                ctx.token_advantages[cut],
                m,
            )
            loss = aggregate(terms.loss, m, how, normaliser, global_samples)
            tis = terms.tis_weight
            sums.add_(
                torch.tensor(
                    [
                        loss.item(),
                        reduce_global(terms.pg.detach(), m, global_tokens).item(),
                        reduce_global(ppo_kl(logp.detach(), ctx.old_logp[cut]), m, global_tokens).item(),
                        reduce_global(ent.detach(), m, global_tokens).item(),
                        reduce_global(terms.clipped, m, global_tokens).item(),
                        0.0 if terms.kl is None else reduce_global(terms.kl.detach(), m, global_tokens).item(),
                        len(mb.rows),
                        0.0 if tis is None else reduce_global(tis, m, global_tokens).item(),
                        0.0
                        if tis is None
                        else reduce_global((tis >= spec.algorithm.tis_cap).float(), m, global_tokens).item(),
                        0.0 if terms.opsm_masked is None else reduce_global(terms.opsm_masked, m, global_tokens).item(),
                        0.0,  # the value loss and its clip fraction: the critic's pass adds them
                        0.0,
                    ]
                )
            )
            return loss

        inputs = [mb.model_input for mb in micro_batches]
        learns = backward and not self._critic_only(ctx)
        with self._counting_agreement() if measure_gap else contextlib.nullcontext():
            if self.expert_load is None or not learns:
                run_micro_batches(self.model, inputs, score, learns)
            else:
                self._scale_aux_loss(len(micro_batches))
                with self.expert_load.counting():
                    run_micro_batches(self.model, inputs, score, learns)
        if measure_gap:
            ctx.logprob_gap = (ctx.logprob_gap or LogprobGap(0.0, None)).over_stages(self.device)
        if self.critic is not None:
            value_sums = self.critic.shard_loss(
                micro_batches,
                ctx.old_values,
                ctx.returns,
                ctx.mask,
                lambda per_token, m: aggregate(per_token, m, how, normaliser, global_samples),
                global_tokens,
                backward=backward,
            )
            start = METRIC_NAMES.index("value_loss")
            sums[start : start + 2] = torch.tensor(value_sums)
        return sums

    def _counting_agreement(self):
        """Inside the block the routers count how often the engine chose as they would (with routing replay):
        in the rollout's first pass on the weights that generated it."""
        if self.routing_replay is None:
            return contextlib.nullcontext()
        return self.routing_replay.counting_agreement()

    @staticmethod
    def _on_policy(rollout_id: int, batch: RolloutBatch) -> torch.Tensor:
        """Which samples the weights the trainer holds for ``rollout_id`` generated: those of version
        ``rollout_id``, the trained rollouts before it being 0 to rollout_id - 1."""
        return batch.weight_versions == rollout_id

    def step(self, ctx: RolloutContext, index: int) -> StepOutcome:
        """Step ``index`` of the rollout, under the quorum the caller has started."""
        spec = self.spec
        step_started = time.monotonic()
        replicas = spec.trainer.replicas.max  # every replica slot the job may hold: the same size everywhere
        global_batch = spec.trainer.global_batch_size
        rows = torch.arange(index * global_batch, (index + 1) * global_batch)
        rank = self.manager.participating_rank() or 0
        shards = rows.tensor_split(self.manager.num_participants())
        global_tokens = int(ctx.mask[rows].sum().item())

        flat = self.reduced
        flat.zero_()  # the gradients (every .grad is a view of it), sums and verdicts of the last step
        if self.master is not None:
            self.master.zero_grad()
        critic_gradients = [] if self.critic is None else [self.critic.gradients]
        for gradients in critic_gradients:
            gradients.zero_()
        measure_gap = spec.algorithm.use_rollout_logprobs and index == 0
        mine = self._data_rank_part(shards[rank])
        sums = self._shard_loss(ctx, mine, global_tokens, global_batch, backward=True, measure_gap=measure_gap)
        critic_summed = [] if self.critic is None else self.critic.summed_over_tensor_ranks
        for param in [*self.summed_over_tensor_ranks, *critic_summed]:
            torch.distributed.all_reduce(gradient_of(param), group=parallel_state.get_tensor_model_parallel_group())
        local_finite = (
            bool(sums.isfinite().all())
            and bool(grad_norm(self.parameters).isfinite())
            and all(all_finite(gradients) for gradients in critic_gradients)
        )
        own_time = self._replica_time(time.monotonic() - step_started)

        # One all-reduce (beside it, megatron's gradient buffers with bf16 parameters): gradients, metric sums,
        # and per replica slot its verdict, its shard and its time. Inside
        # the replica first (its data-parallel ranks' sums: a verdict counts the ranks that saw a NaN, the
        # shard and the time are given once), then across replicas, each rank with its peers of the same place.
        offset = self.gradient_size
        flat[offset : offset + len(METRIC_NAMES)] = sums.to(self.device)
        verdicts = flat[offset + len(METRIC_NAMES) :]
        gives_once = self.data_rank == 0 and self.context_rank == 0 and self.first_stage
        verdicts[self.replica] = 0.0 if local_finite else 1.0
        verdicts[replicas + self.replica] = rank + 1 if gives_once else 0.0
        verdicts[2 * replicas + self.replica] = own_time if gives_once else 0.0
        sum_over_stages(flat[offset:])  # the last stage's metric sums; every stage's verdict
        self._sum_over_context_ranks(flat[:offset], verdicts)
        self._sum_step_over_data_ranks(flat)
        for buffer in [*self.gradient_buffers, *critic_gradients]:
            self._sum_over_data_ranks(buffer)
        summed = [flat, *self.gradient_buffers, *critic_gradients]
        pending = [self.manager.allreduce(t, reduce_op=torch.distributed.ReduceOp.SUM) for t in summed]
        for work in pending:
            work.wait()
        sums = flat[offset : offset + len(METRIC_NAMES)]

        decision = Decision(Response.COMMIT)
        participants = frozenset(r for r in range(replicas) if verdicts[replicas + r] > 0)
        if self.manager.errored() is None:
            health = StepHealth(
                participants=participants,
                nonfinite=frozenset(r for r in range(replicas) if verdicts[r] > 0),
                reduced_finite=all(all_finite(t) for t in summed),
            )
            if health.nonfinite:
                health = self._recompute(ctx, health, shards, verdicts, global_tokens)
            decision = decide(health, self.consecutive_skips, spec.fault_tolerance.max_consecutive_nan_skips)
            if decision.response is not Response.COMMIT:
                self.manager.report_error(NonFiniteStep(decision.reason))

        norm = grad_norm(self.parameters)
        straggling = None
        committed = self.manager.should_commit()
        gate_time = self.before_optimizer_step()
        if committed:
            if not self._critic_only(ctx):
                if self.master is None:
                    torch.nn.utils.clip_grads_with_norm_(self.parameters, spec.trainer.clip_grad, norm)
                else:
                    self.master.clip(spec.trainer.clip_grad, norm)
                self.optimizer.step()
                self.scheduler.step()
            if self.critic is not None:
                ctx.metrics.add(critic_grad_norm=self.critic.step(spec.trainer.clip_grad))
            self.consecutive_skips = 0
            if index == 0:
                ctx.metrics.add(first_step_ppo_kl=sums[METRIC_NAMES.index("ppo_kl")])
            straggling = self._watch_stragglers({r: verdicts[2 * replicas + r].item() for r in participants})
            ctx.metrics.add(
                **dict(zip(METRIC_NAMES, sums.tolist())),
                grad_norm=norm.item(),
                step_time=time.monotonic() - step_started,
                compute_time=own_time,
                straggler_ratio=straggling.ratio,
                snapshot_gate_time=gate_time,
                participants=self.manager.num_participants(),
            )
        elif decision.response is Response.SKIP:
            self.consecutive_skips += 1
        return StepOutcome(committed, decision, leader=rank == 0, straggling=straggling)

    def _replica_time(self, seconds: float) -> float:
        """The replica's own time for the step: its slowest rank's, so that every rank of a replica holds
        the same times and reaches the same straggler verdict."""
        if torch.distributed.get_world_size() == 1:
            return seconds
        slowest = torch.tensor([seconds], device=self.device)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        return slowest.item()

    def _watch_stragglers(self, times: dict[int, float]) -> StragglerVerdict:
        """A committed step's times: the runs of slow steps they extend or end (``policies.straggler``)."""
        rule = self.spec.fault_tolerance.straggler_rule
        if rule is None:
            return StragglerVerdict({}, frozenset(), peer_ratios(times))
        verdict = judge(times, self.straggler_streaks, rule)
        self.straggler_streaks = verdict.streaks
        return verdict

    def _scale_aux_loss(self, micro_batches: int) -> None:
        """A mixture of experts' load-balancing loss: each of this rank's micro-batches weighs
        1/micro_batches of its gradient, and the step's ranks are averaged (the step sums them)."""
        ranks = self.manager.num_participants() * self.data_ranks
        micro_batches = micro_batches_over_expert_ranks(micro_batches)  # the empty ones added to match
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / (micro_batches * ranks), device=self.device))

    def _data_rank_part(self, shard: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's rows of its replica's ``shard``."""
        return shard.tensor_split(self.data_ranks)[self.data_rank]

    def _sum_over_data_ranks(self, tensor: torch.Tensor) -> None:
        if self.data_ranks > 1:
            torch.distributed.all_reduce(tensor, group=parallel_state.get_data_parallel_group())

    def _sum_over_context_ranks(self, *tensors: torch.Tensor) -> None:
        """Context parallelism: each rank's gradients hold its own tokens' share, and a verdict counts the
        ranks that saw a NaN. The metric sums are every rank's already (the scores were summed)."""
        if self.context_ranks > 1:
            for tensor in tensors:
                torch.distributed.all_reduce(tensor, group=parallel_state.get_context_parallel_group())

    def _sum_step_over_data_ranks(self, flat: torch.Tensor) -> None:
        """Sum the step's all-reduce buffer over the replica's data-parallel ranks. A rank's own experts are
        summed over the ranks holding the same experts only: their gradients already hold every
        expert-parallel rank's tokens (megatron's dispatcher sent them back)."""
        experts = self.expert_gradient_size
        self._sum_over_data_ranks(flat[experts:])
        if experts and parallel_state.get_expert_data_parallel_world_size() > 1:
            torch.distributed.all_reduce(flat[:experts], group=parallel_state.get_expert_data_parallel_group())

    @torch.no_grad()
    def _recompute(
        self,
        ctx: RolloutContext,
        health: StepHealth,
        shards: tuple[torch.Tensor, ...],
        verdicts: torch.Tensor,
        global_tokens: int,
    ) -> StepHealth:
        """Rerun each non-finite shard on its own replica, then the persistent ones on a healthy replica."""
        replicas = self.spec.trainer.replicas.max

        def finite_on(shard_owner: int) -> float:
            """Every data-parallel rank of this replica reruns its part; finite only if all of them are (as
            the last stage of each scores it)."""
            shard = shards[int(verdicts[replicas + shard_owner].item()) - 1]
            part = self._data_rank_part(shard)
            sums = self._shard_loss(ctx, part, global_tokens, self.spec.trainer.global_batch_size, backward=False)
            nonfinite = torch.tensor([0.0 if bool(sums.isfinite().all()) else 1.0], device=self.device)
            sum_over_stages(nonfinite)
            self._sum_over_context_ranks(nonfinite)
            self._sum_over_data_ranks(nonfinite)
            return 1.0 if nonfinite.item() == 0 else 0.0

        rerun = torch.zeros(replicas, device=self.device)
        if self.replica in health.nonfinite:
            rerun[self.replica] = finite_on(self.replica)
        self.manager.allreduce(rerun, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        health = replace(health, transient=frozenset(r for r in range(replicas) if rerun[r] > 0))
        if not needs_recompute_elsewhere(health):
            return health
        elsewhere = torch.zeros(replicas, device=self.device)
        if self.replica == min(health.participants - health.nonfinite):
            for bad in health.persistent:
                elsewhere[bad] = finite_on(bad)
        self.manager.allreduce(elsewhere, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        return replace(health, finite_elsewhere=frozenset(r for r in range(replicas) if elsewhere[r] > 0))

    def rollout_metrics(self, ctx: RolloutContext) -> dict[str, float]:
        means = ctx.metrics.means()
        algorithm = self.spec.algorithm
        if algorithm.kind is AlgorithmKind.SFT:
            means = {name: value for name, value in means.items() if name not in POLICY_GRADIENT_ONLY}
        if algorithm.tis_cap is None:
            means = {name: value for name, value in means.items() if name not in TIS_ONLY}
        if not algorithm.opsm:
            means = {name: value for name, value in means.items() if name not in OPSM_ONLY}
        if self.critic is None:
            means = {name: value for name, value in means.items() if name not in CRITIC_ONLY}
        result = {f"train/{name}": value for name, value in means.items()}
        if ctx.logprob_gap is not None:
            result["train/logprob_abs_diff_max"] = ctx.logprob_gap.every
            if ctx.logprob_gap.on_policy is not None:
                result["train/on_policy_logprob_abs_diff_max"] = ctx.logprob_gap.on_policy
        if ctx.ref_gap is not None:
            result["train/ref_logprob_abs_diff_max"] = ctx.ref_gap
        if ctx.distillation_kl is not None:
            result["train/distillation_reverse_kl"] = ctx.distillation_kl
        if ctx.explained_variance is not None:
            result["train/explained_variance"] = ctx.explained_variance
        # The snapshot gate's cost is the rollout's total, not a per-step mean.
        result["train/snapshot_gate_time"] = sum(ctx.metrics.values.get("snapshot_gate_time", []))
        if self.expert_load is not None:
            result.update(self.expert_load.take_metrics())
        if self.routing_replay is not None:
            agreement = self.routing_replay.take_agreement()
            if agreement is not None:
                result["train/routing_agreement"] = agreement
        result["train/lr"] = self.scheduler.get_last_lr()[0]
        result["train/rollout_train_time"] = time.monotonic() - ctx.started
        result["train/prepare_time"] = ctx.prepare_time
        return result
