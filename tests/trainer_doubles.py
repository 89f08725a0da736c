"""What tests and benchmarks of the trainer's step give it in place of a job: a quorum of one replica, a
replica built on it, and synthetic rollout batches."""

from __future__ import annotations

import torch

from checkpoints.rollout_log import RolloutBatch, response_mask
from checkpoints.snapshot import TrainingState
from elastic_rl.spec.job import JobSpec
from elastic_rl.trainer.grpo import GrpoTrainer
from elastic_rl.trainer.lr_schedule import lr_lambda
from elastic_rl.trainer.optimizer import build_optimizer, local_optimizer, main_weights, scheduled


class _Done:
    def wait(self) -> None:
        pass


class FakeSoloQuorum:
    """Stands in for torchft's Manager with one replica: nothing to all-reduce, every step commits."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def start_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return 1

    def participating_rank(self) -> int:
        return 0

    def allreduce(self, tensor: torch.Tensor, reduce_op=None) -> _Done:
        return _Done()

    def errored(self):
        return None

    def report_error(self, error: Exception) -> None:
        raise error

    def should_commit(self) -> bool:
        self.step += 1
        return True


def solo_replica(
    spec: JobSpec, model: torch.nn.Module, reference: torch.nn.Module | None = None
) -> tuple[GrpoTrainer, TrainingState]:
    """``model``'s trainer under ``FakeSoloQuorum`` and the state a snapshot takes, built as a job's replica
    builds them: the spec's optimizer and its learning-rate schedule (over 100 steps)."""
    optimizer = build_optimizer(model, spec.trainer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled(optimizer), lr_lambda(spec.trainer, 100))
    trainer = GrpoTrainer(spec, model, optimizer, scheduler, FakeSoloQuorum(), replica=0, reference=reference)
    return trainer, TrainingState(model, local_optimizer(optimizer), scheduler, main_weights(optimizer))


def rollout_batch(
    tokens: torch.Tensor, prompts: torch.Tensor, responses: torch.Tensor, generator: torch.Generator
) -> RolloutBatch:
    """A rollout of ``tokens`` (samples x width) with these prompt and response lengths, random engine log
    probabilities and rewards, each sample its own prompt."""
    samples, width = tokens.shape
    return RolloutBatch(
        tokens=tokens,
        prompt_lengths=prompts,
        response_lengths=responses,
        engine_logprobs=-torch.rand(samples, width, generator=generator),
        rewards=torch.rand(samples, generator=generator),
        prompt_indices=torch.arange(samples),
        prompt_epochs=torch.zeros(samples, dtype=torch.long),
        weight_versions=torch.zeros(samples, dtype=torch.long),
        loss_mask=response_mask(prompts, responses, width),
    )
