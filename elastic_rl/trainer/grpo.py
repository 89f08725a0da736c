"""One rollout's training: log probabilities, the GRPO loss, and optimizer steps under torchft.

``GrpoTrainer.train_rollout`` takes a committed rollout batch and runs
``samples / global_batch_size`` optimizer steps on it. Each step's global
batch is split by the torchft quorum (participant i of n takes shard i), the
loss is normalised by the global batch's response tokens, gradients are summed
across replicas, and the step is taken only if the Manager commits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state

from elastic_rl.algo.advantages import grpo_advantages
from elastic_rl.algo.kl import KL_ESTIMATORS
from elastic_rl.algo.losses import ppo_clipped_loss, ppo_kl, reduce_global
from elastic_rl.config import JobSpec
from elastic_rl.model.gpt import forward_gpt
from elastic_rl.model.vocab_parallel import entropy, token_log_probs
from elastic_rl.rollout.batch import RolloutBatch


def lr_lambda(spec: JobSpec, total_steps: int):
    """The learning-rate multiplier at each optimizer step: warmup, then the spec's decay."""
    trainer = spec.trainer
    floor = trainer.min_lr / trainer.lr

    def multiplier(step: int) -> float:
        if trainer.warmup_steps and step < trainer.warmup_steps:
            return (step + 1) / trainer.warmup_steps
        if trainer.lr_decay == "constant":
            return 1.0
        progress = min(1.0, (step - trainer.warmup_steps) / max(1, total_steps - trainer.warmup_steps))
        if trainer.lr_decay == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def sequence_log_probs(
    model: torch.nn.Module, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, entropy) of each token given its prefix, aligned to ``tokens`` (position 0 is 0)."""
    logits = forward_gpt(model, tokens[:, :-1])
    if temperature > 0:
        logits = logits / temperature
    logp = token_log_probs(logits, tokens[:, 1:])
    ent = entropy(logits)
    pad = torch.zeros(tokens.shape[0], 1)
    return torch.cat([pad, logp], dim=1), torch.cat([pad, ent], dim=1)


def grad_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """The global gradient norm: tensor-parallel shards summed across ranks, replicated ones once."""
    sharded = torch.zeros(())
    replicated = torch.zeros(())
    for param in parameters:
        if param.grad is None:
            continue
        squares = param.grad.detach().float().pow(2).sum()
        if getattr(param, "tensor_model_parallel", False):
            sharded += squares
        else:
            replicated += squares
    torch.distributed.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
    return (sharded + replicated).sqrt()


@dataclass
class StepMetrics:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, **named: float) -> None:
        for name, value in named.items():
            self.values.setdefault(name, []).append(float(value))

    def means(self) -> dict[str, float]:
        return {name: sum(v) / len(v) for name, v in self.values.items()}


class GrpoTrainer:
    def __init__(self, spec: JobSpec, model, optimizer, scheduler, manager, reference=None, before_optimizer_step=None):
        self.spec = spec
        # Called before each optimizer step, which changes the state a snapshot may still be copying;
        # returns the seconds it blocked.
        self.before_optimizer_step = before_optimizer_step or (lambda: 0.0)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.manager = manager
        self.reference = reference
        self.parameters = [p for p in model.parameters() if p.requires_grad]

    def _micro_batches(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(rows.split(self.spec.trainer.micro_batch_size))

    @torch.no_grad()
    def _log_probs(self, model, batch: RolloutBatch) -> torch.Tensor:
        rows = torch.arange(batch.size)
        temperature = self.spec.rollout.temperature
        return torch.cat([sequence_log_probs(model, batch.tokens[mb], temperature)[0] for mb in self._micro_batches(rows)])

    def train_rollout(self, batch: RolloutBatch) -> dict[str, float]:
        spec = self.spec
        started = time.monotonic()
        mask = batch.response_mask()
        advantages = grpo_advantages(
            batch.rewards, spec.rollout.n_samples_per_prompt, spec.algorithm.normalize_advantages_by_std
        )
        token_advantages = advantages.unsqueeze(1) * mask
        # The policy before this rollout's first step: PPO's "old" log probabilities.
        old_logp = self._log_probs(self.model, batch)
        ref_logp = self._log_probs(self.reference, batch) if self.reference is not None else None
        logprob_gap = ((old_logp - batch.engine_logprobs).abs() * mask).max().item()

        metrics = StepMetrics()
        gate_time = 0.0
        global_batch = spec.trainer.global_batch_size
        for step in range(batch.size // global_batch):
            step_started = time.monotonic()
            rows = torch.arange(step * global_batch, (step + 1) * global_batch)
            self.manager.start_quorum()
            shard = rows.tensor_split(self.manager.num_participants())[self.manager.participating_rank() or 0]
            global_tokens = int(mask[rows].sum().item())
            sums = {"loss": 0.0, "pg_loss": 0.0, "ppo_kl": 0.0, "entropy": 0.0, "clipfrac": 0.0, "kl": 0.0}
            self.optimizer.zero_grad(set_to_none=False)
            for mb in self._micro_batches(shard):
                m = mask[mb]
                logp, ent = sequence_log_probs(self.model, batch.tokens[mb], spec.rollout.temperature)
                pg, clipped = ppo_clipped_loss(
                    logp, old_logp[mb], token_advantages[mb], spec.algorithm.eps_clip, spec.algorithm.eps_clip_high
                )
                loss_tokens = pg - spec.algorithm.entropy_coef * ent
                if ref_logp is not None:
                    kl = KL_ESTIMATORS[spec.algorithm.kl_estimator](logp, ref_logp[mb])
                    loss_tokens = loss_tokens + spec.algorithm.kl_coef * kl
                    sums["kl"] += reduce_global(kl.detach(), m, global_tokens).item()
                loss = reduce_global(loss_tokens, m, global_tokens)
                loss.backward()
                sums["loss"] += loss.item()
                sums["pg_loss"] += reduce_global(pg.detach(), m, global_tokens).item()
                sums["ppo_kl"] += reduce_global(ppo_kl(logp.detach(), old_logp[mb]), m, global_tokens).item()
                sums["entropy"] += reduce_global(ent.detach(), m, global_tokens).item()
                sums["clipfrac"] += reduce_global(clipped, m, global_tokens).item()
            for param in self.parameters:
                self.manager.allreduce(param.grad, reduce_op=torch.distributed.ReduceOp.SUM).wait()
            norm = grad_norm(self.parameters)
            committed = self.manager.should_commit()
            gate_time += self.before_optimizer_step()
            if committed:
                torch.nn.utils.clip_grads_with_norm_(self.parameters, spec.trainer.clip_grad, norm)
                self.optimizer.step()
                self.scheduler.step()
            if step == 0:
                metrics.add(first_step_ppo_kl=sums["ppo_kl"])
            metrics.add(**sums, grad_norm=norm.item(), committed=float(committed),
                        step_time=time.monotonic() - step_started)  # fmt: skip
        result = {f"train/{name}": value for name, value in metrics.means().items()}
        result["train/logprob_abs_diff_max"] = logprob_gap
        result["train/snapshot_gate_time"] = gate_time
        result["train/lr"] = self.scheduler.get_last_lr()[0]
        result["train/rollout_train_time"] = time.monotonic() - started
        return result
